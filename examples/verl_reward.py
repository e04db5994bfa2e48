"""verl 0.9.x on qrq: run `python examples/verl_reward.py` (mock judge, no GPU, no verl needed).

In training, add to your verl command line (the `reward.*` keys; verl 0.9 ignores the legacy
top-level ones):

    reward.reward_manager.source=importlib \\
    reward.reward_manager.name=QrqRewardManager \\
    reward.reward_manager.module.path=pkg://qreward_queue.integrations.verl \\
    +reward.qrq.route=judge \\
    +ray_kwargs.ray_init.runtime_env.env_vars.QRQ_REDIS_URL=redis://host:6379/0 \\
    +ray_kwargs.ray_init.runtime_env.env_vars.QRQ_CONFIG=/shared/qrq.toml

This script calls the plain-function contract the way verl's naive manager does: by keyword,
one sample per call, many calls at once, with a numpy data_source, a non-string ground truth
and an extra_info verl has mutated (numpy num_turns).
"""

from __future__ import annotations

import asyncio
import json

from _mock_stack import mock_stack, needs

from qreward_queue.integrations.verl import compute_score

np = needs("numpy")  # the trainer hands numpy values over; `pip install 'qreward-queue[examples]'`


async def agent_loop() -> list[dict]:
    rows = [("4", "train"), ("5", "train"), ("four", "test"), ("2+2=4", "test")]
    return await asyncio.gather(*(
        compute_score(data_source=np.str_("demo/arith"), solution_str=response, ground_truth=4,
                      extra_info={"question": "What is 2+2?", "split": split,
                                  "num_turns": np.int64(1)}, route="judge")
        for response, split in rows))


if __name__ == "__main__":
    with mock_stack():
        for result in asyncio.run(agent_loop()):
            print(json.dumps(result))
