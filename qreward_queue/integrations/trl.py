"""TRL (GRPOTrainer / RLOOTrainer, >= 1.6): an async reward function on qrq.

    from qreward_queue.integrations.trl import qrq_reward
    trainer = GRPOTrainer(..., reward_funcs=[qrq_reward(route="judge")])
    # or: trl grpo --reward_funcs qreward_queue.integrations.trl.judge   (the default route)

TRL calls `reward(prompts=..., completions=..., completion_ids=..., **columns)` once per
generation batch in each process, awaiting async functions together on its own loop. Route
and deadline are fixed when the function is made, so a dataset column of the same name cannot
override them. An unscored sample returns None: TRL >= 1.6 leaves it out of the group
baseline (advantage 0) instead of training on a fallback score. The reference is read from
the first present column among `reference_columns`; a `qrq_priority` column ("val") marks
validation rows, unless the function was made with a fixed `priority`.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ..priority import Priority
from ..samples import summarize
from ..trainer.batcher import default_batcher
from .coerce import make_sample
from .guard import require_shared_limits

REFERENCE_COLUMNS = ("solution", "answer", "reference", "ground_truth")

RewardFunc = Callable[..., Awaitable[list[float | None]]]


def qrq_reward(
    route: str | None = None,
    *,
    name: str = "qrq",
    priority: Priority | None = None,
    deadline_s: float | None = None,
    reference_columns: Sequence[str] = REFERENCE_COLUMNS,
    job: str | None = None,
) -> RewardFunc:
    """An async TRL reward function scoring on `route`; `name` is TRL's column/metric name.
    A fixed `priority` wins over the `qrq_priority` column (e.g. "val" for an eval-only copy).
    `job` names the training run (fair shares and spend per job; else $QRQ_JOB)."""

    async def reward(
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[Any] | None = None,
        log_extra: Callable[[str, list[Any]], None] | None = None,
        log_metric: Callable[[str, float], None] | None = None,
        **columns: Any,
    ) -> list[float | None]:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            require_shared_limits("TRL with several processes")
        refs = next((columns[c] for c in reference_columns if c in columns), None)
        refs = refs if refs is not None else [None] * len(completions)
        column = columns.get("qrq_priority") or [Priority.TRAIN] * len(completions)
        samples = [make_sample(p, c, r) for p, c, r in zip(prompts, completions, refs,
                                                             strict=True)]
        priorities = [priority or Priority.marked(p) for p in column]
        outcomes = await default_batcher().score_many(samples, route, priorities, deadline_s,
                                                      job)
        if log_extra is not None:
            log_extra(f"{name}_status", [o.status for o in outcomes])
        if log_metric is not None:
            log_metric(f"{name}/unscored_frac", sum(not o.scored for o in outcomes) / len(outcomes))
            summary = summarize(outcomes)
            for status, count in summary["by_status"].items():
                log_metric(f"{name}/{status}", count)
            log_metric(f"{name}/retries", summary["retries"])
        return [o.reward if o.scored else None for o in outcomes]

    reward.__name__ = reward.__qualname__ = name
    return reward


judge = qrq_reward()  # the default route of qrq.toml, for `trl grpo --reward_funcs`
