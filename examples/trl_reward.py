"""TRL on qrq: run `python examples/trl_reward.py` (mock judge, no GPU, no TRL needed).

In training:

    from qreward_queue.integrations.trl import qrq_reward
    trainer = GRPOTrainer(model=..., reward_funcs=[qrq_reward("judge", name="judge")], ...)

or `trl grpo --reward_funcs qreward_queue.integrations.trl.judge` (qrq.toml's default route).
This script calls the reward the way GRPOTrainer._calculate_rewards does: keywords, dataset
columns as lists (here `solution`), and the log_extra / log_metric callbacks.
"""

from __future__ import annotations

import asyncio
import json

from _mock_stack import mock_stack

from qreward_queue.integrations.trl import qrq_reward

if __name__ == "__main__":
    with mock_stack():
        logged: dict = {}
        scores = asyncio.run(qrq_reward("judge", name="judge")(
            prompts=[[{"role": "user", "content": "What is 2+2?"}]] * 4,
            completions=[[{"role": "assistant", "content": c}] for c in ["4", "5", "four", "=4"]],
            completion_ids=[[0]] * 4, solution=["4"] * 4, trainer_state=None,
            log_extra=logged.__setitem__, log_metric=logged.__setitem__))
        for score, status in zip(scores, logged["judge_status"], strict=True):
            print(json.dumps({"score": score, "qrq_status": status}))
