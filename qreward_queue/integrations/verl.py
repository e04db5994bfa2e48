"""verl (0.7.1 to 0.9.x): a reward manager and a custom reward function on qrq.

verl calls reward code once per sample, concurrently, in `reward.num_workers` (8) processes;
both entry points go through the process's micro-batcher, so those calls reach the queue as
batches. Recommended (sees the prompt through `raw_prompt`):

    reward.reward_manager.source=importlib
    reward.reward_manager.name=QrqRewardManager
    reward.reward_manager.module.path=pkg://qreward_queue.integrations.verl
    +reward.qrq.route=judge
    +ray_kwargs.ray_init.runtime_env.env_vars.QRQ_REDIS_URL=redis://host:6379/0
    +ray_kwargs.ray_init.runtime_env.env_vars.QRQ_CONFIG=/path/to/qrq.toml

Or a plain function (verl passes no prompt: put it in extra_info["question"]):

    reward.custom_reward_function.path=pkg://qreward_queue.integrations.verl
    reward.custom_reward_function.name=compute_score
    +reward.custom_reward_function.reward_kwargs.route=judge

With qrq installed, verl's plugin loader also registers the manager as "qrq":
`reward.reward_manager.name=qrq` replaces the first three lines above.

A sample that could not be scored gets the fallback score and `qrq_ok = 0.0`; every path
returns the same `reward_extra_info` keys with non-None values, because verl builds arrays
from the keys of the first sample. `+reward.qrq.on_unscored=raise` raises instead (the V1
trainer then drops the trajectory). Priority is `val` when extra_info["qrq_priority"] is
"val" or extra_info["split"] is test/val/validation.

Group judging (one judge call per GRPO group): put the route on a judge with
`mode = "group"` and tell the batcher the group size (`actor_rollout_ref.rollout.n`):
`+ray_kwargs.ray_init.runtime_env.env_vars.QRQ_BATCH_GROUP_SIZE=8`. Each process holds a
prompt's responses until it has 8 (or QRQ_BATCH_GROUP_WAIT_MS, 2000, has passed), then sends
the group whole; groups are assembled per process, so keep `reward.num_workers` such that a
group's responses reach one process, or accept smaller groups after the wait.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..priority import Priority
from ..samples import Outcome
from ..trainer.batcher import default_batcher
from .coerce import make_sample, render_chat
from .guard import require_shared_limits, unscored_error

try:  # the base class only exists where verl is installed; the interface is the same
    from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase
    from verl.experimental.reward_loop.reward_manager.registry import register
except ImportError:  # pragma: no cover - exercised where verl is absent
    register = None

    class RewardManagerBase:  # type: ignore[no-redef]
        def __init__(self, config: Any, tokenizer: Any, compute_score: Any = None):
            self.config, self.tokenizer = config, tokenizer


VAL_SPLITS = frozenset({"test", "val", "valid", "validation", "eval"})
EXTRA_KEYS = ("acc", "qrq_ok", "qrq_status", "qrq_backend")


def priority_of(extra_info: Mapping[str, Any] | None) -> Priority:
    """`val` for validation rows (explicit qrq_priority, or the preprocess scripts' split)."""
    extra = extra_info or {}
    if extra.get("qrq_priority") in {p.value for p in Priority}:
        return Priority(extra["qrq_priority"])
    return Priority.VAL if str(extra.get("split", "")).lower() in VAL_SPLITS else Priority.TRAIN


def extra_info_of(outcome: Outcome) -> dict[str, float | str]:
    """The fixed reward_extra_info keys (EXTRA_KEYS), never None."""
    return {
        "acc": outcome.reward,
        "qrq_ok": 1.0 if outcome.scored else 0.0,
        "qrq_status": outcome.status,
        "qrq_backend": outcome.backend or "",
    }


async def _score(prompt: Any, response: str, ground_truth: Any, data_source: Any,
                 extra_info: Mapping[str, Any] | None, route: str | None, deadline_s: float | None,
                 on_unscored: str) -> Outcome:
    extra = dict(extra_info or {})  # a copy: verl mutates and shares this dict
    sample = make_sample(prompt, response, ground_truth, data_source, extra)
    outcome = await default_batcher().score(sample, route, priority_of(extra), deadline_s)
    if on_unscored == "raise" and not outcome.scored:
        raise unscored_error(outcome)
    return outcome


async def compute_score(
    data_source: Any = None,
    solution_str: str = "",
    ground_truth: Any = None,
    extra_info: Mapping[str, Any] | None = None,
    route: str | None = None,
    deadline_s: float | None = None,
    on_unscored: str = "fallback",
    **_: Any,
) -> dict[str, float | str]:
    """verl's custom reward function contract (keyword call, async); the prompt is taken from
    extra_info["question"] or extra_info["prompt"]."""
    require_shared_limits("verl")
    extra = extra_info or {}
    prompt = extra.get("question", extra.get("prompt", ""))
    outcome = await _score(prompt, solution_str, ground_truth, data_source, extra, route,
                           deadline_s, on_unscored)
    return {"score": outcome.reward, **extra_info_of(outcome)}


class QrqRewardManager(RewardManagerBase):  # type: ignore[misc]  # verl has no type hints
    """verl reward manager: `run_single` scores the last sequence of `data` on qrq.

    Settings come from `+reward.qrq.{route,deadline_s,on_unscored}` in verl's config.
    """

    def __init__(self, config: Any, tokenizer: Any, compute_score: Any = None,
                 reward_router_address: Any = None, reward_model_tokenizer: Any = None,
                 **_: Any):
        super().__init__(config, tokenizer, compute_score)
        settings = _qrq_settings(config)
        self.route = settings.get("route")
        self.deadline_s = settings.get("deadline_s")
        self.on_unscored = str(settings.get("on_unscored", "fallback"))
        require_shared_limits("verl")

    async def run_single(self, data: Any) -> dict[str, Any]:
        item = data[-1]  # multi-output trajectories: the last sequence is scored, as naive does
        ids = item.batch["responses"]
        length = int(item.batch["attention_mask"][-ids.shape[-1]:].sum())
        response = self.tokenizer.decode(ids[:length], skip_special_tokens=True)
        nt = item.non_tensor_batch
        extra = dict(nt.get("extra_info") or {})
        prompt = render_chat(nt.get("raw_prompt")) or extra.get("question") or self._prompt(item)
        truth = (nt.get("reward_model") or {}).get("ground_truth")
        outcome = await _score(prompt, response, truth, nt.get("data_source"), extra,
                               self.route, self.deadline_s, self.on_unscored)
        return {"reward_score": outcome.reward, "reward_extra_info": extra_info_of(outcome)}

    def _prompt(self, item: Any) -> str:
        ids = item.batch["prompts"]
        mask = item.batch["attention_mask"][: ids.shape[-1]]
        text: str = self.tokenizer.decode(ids[mask == 1], skip_special_tokens=True)
        return text


def _qrq_settings(config: Any) -> dict[str, Any]:
    reward = config.get("reward") if hasattr(config, "get") else None
    found = reward.get("qrq") if reward is not None and hasattr(reward, "get") else None
    return dict(found or {})


if register is not None:  # `reward.reward_manager.name=qrq` (with the verl.plugins entry point)
    register("qrq")(QrqRewardManager)
