"""AReaL (1.0.x): score RLVR episodes on qrq from the workflow coroutine.

AReaL's plain `reward_fn` runs in a process pool under a 15 s limit that turns a slow judge
into a silent 0, and cannot see whether the rollout is for evaluation. Override the
workflow's `_compute_rewards` instead:

    from areal.workflow.rlvr import RLVRWorkflow
    from qreward_queue.integrations.areal import QrqRewardMixin

    class QrqRLVRWorkflow(QrqRewardMixin, RLVRWorkflow):
        qrq_route = "judge"

    workflow = QrqRLVRWorkflow(reward_fn="qreward_queue.integrations.areal.unused_reward_fn",
                               gconfig=..., tokenizer=...)

Evaluation rollouts (`workflow_context.get().is_eval`) are sent as `val`. An unscored sample
raises, so AReaL rejects the rollout; set `qrq_on_unscored = "fallback"` to train on the
fallback score instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..priority import Priority
from ..trainer.batcher import default_batcher
from .coerce import make_sample
from .guard import require_shared_limits, unscored_error

REFERENCE_KEYS = ("answer", "solution", "reference", "label", "ground_truth")


def is_eval() -> bool:
    """AReaL's eval flag for the running workflow (False where AReaL is absent)."""
    try:
        from areal.infra import workflow_context
    except ImportError:
        return False
    return bool(getattr(workflow_context.get(), "is_eval", False))


async def score_episode(prompt: str, completion: str, task_data: Mapping[str, Any],
                        route: str | None = None, on_unscored: str = "raise",
                        evaluation: bool = False) -> float:
    """The reward of one episode; raises on an unscored sample unless on_unscored='fallback'."""
    require_shared_limits("AReaL")
    reference = next((task_data[k] for k in REFERENCE_KEYS if task_data.get(k) is not None),
                     None)
    outcome = await default_batcher().score(make_sample(prompt, completion, reference), route,
                                            Priority.VAL if evaluation else Priority.TRAIN)
    if not outcome.scored and on_unscored == "raise":
        raise unscored_error(outcome)
    return outcome.reward


class QrqRewardMixin:
    """Put before RLVRWorkflow in the bases; replaces its `_compute_rewards`."""

    qrq_route: str | None = None
    qrq_on_unscored: str = "raise"
    tokenizer: Any

    async def _compute_rewards(self, resp: Any, prompt_str: str,
                               task_data: dict[str, Any]) -> float:
        completion = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
        return await score_episode(prompt_str, completion, task_data, self.qrq_route,
                                   self.qrq_on_unscored, is_eval())


def unused_reward_fn(*_: Any, **__: Any) -> float:
    """A module-level stand-in for RLVRWorkflow's required reward_fn (never called)."""
    raise RuntimeError("QrqRewardMixin scores rewards; this reward_fn must not be called")
