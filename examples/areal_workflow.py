"""AReaL on qrq: run `python examples/areal_workflow.py` (mock judge, no GPU, no AReaL needed).

In training, subclass AReaL's RLVR workflow with qrq's mixin first:

    from areal.workflow.rlvr import RLVRWorkflow
    from qreward_queue.integrations.areal import QrqRewardMixin

    class QrqRLVRWorkflow(QrqRewardMixin, RLVRWorkflow):
        qrq_route = "judge"          # qrq_on_unscored = "fallback" to keep unscored rollouts

    workflow = QrqRLVRWorkflow(reward_fn="qreward_queue.integrations.areal.unused_reward_fn",
                               gconfig=gconfig, tokenizer=tokenizer)

Rewards are awaited in the workflow coroutine (no 15 s process-pool limit), evaluation
rollouts go as `val`, and an unscored sample raises so AReaL rejects the rollout. This script
stands in for RLVRWorkflow and its tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import types

from _mock_stack import mock_stack

from qreward_queue.integrations.areal import QrqRewardMixin


class RLVRWorkflow:  # the part of areal.workflow.rlvr.RLVRWorkflow the mixin relies on
    def __init__(self, reward_fn, gconfig, tokenizer):
        self.reward_fn, self.gconfig, self.tokenizer = reward_fn, gconfig, tokenizer


class Words:  # a tokenizer whose token ids are the words themselves
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(ids)


class QrqRLVRWorkflow(QrqRewardMixin, RLVRWorkflow):
    qrq_route = "judge"


async def episodes() -> list[float]:
    workflow = QrqRLVRWorkflow("unused", None, Words())
    return await asyncio.gather(*(
        workflow._compute_rewards(types.SimpleNamespace(output_tokens=answer.split()),
                                  "What is 2+2?", {"answer": "4"})
        for answer in ["4", "it is 5", "four"]))


if __name__ == "__main__":
    with mock_stack():
        for reward in asyncio.run(episodes()):
            print(json.dumps({"score": reward}))
