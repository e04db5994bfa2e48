"""slime: an async custom reward model on qrq.

    --custom-rm-path qreward_queue.integrations.slime.rm
    # route: QRQ_ROUTE in the environment of the rollout workers, else qrq.toml's default

slime awaits `rm(args, sample)` per sample, and `rm(args, samples)` with a list under
`--group-rm`; both shapes are handled. A reward must be a number (None or an exception kills
the rollout), so an unscored sample gets the fallback score, `remove_sample = True` (slime
masks it out of the loss) and its status in `metadata["qrq_status"]`. Validation: put
`metadata_overrides: {qrq_priority: val}` in the eval dataset config.

Group judging (one judge call per GRPO group): put the route on a judge with
`mode = "group"` and run slime with `--group-rm`; each list slime hands over is one group,
sent as soon as it is whole.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from ..priority import Priority
from ..trainer.batcher import default_batcher
from .coerce import make_sample
from .guard import require_shared_limits


async def rm(args: Any, sample_or_samples: Any, **_: Any) -> float | list[float]:
    """slime's custom RM contract: one Sample -> float, a list of Samples -> list[float]."""
    require_shared_limits("slime")
    samples = sample_or_samples if isinstance(sample_or_samples, list) else [sample_or_samples]
    route = getattr(args, "qrq_route", None) or os.environ.get("QRQ_ROUTE") or None
    priorities = [Priority.marked((s.metadata or {}).get("qrq_priority")) for s in samples]
    payload = [make_sample(s.prompt, s.response, s.label) for s in samples]
    if isinstance(sample_or_samples, list):  # --group-rm: the list is one group, whole
        group = uuid.uuid4().hex
        payload = [{**p, "group": group, "group_size": len(payload)} for p in payload]
    outcomes = await default_batcher().score_many(payload, route, priorities)
    for sample, outcome in zip(samples, outcomes, strict=True):
        if sample.metadata is None:
            sample.metadata = {}
        sample.metadata["qrq_status"] = outcome.status
        sample.remove_sample = bool(sample.remove_sample) or not outcome.scored
    scores = [o.reward for o in outcomes]
    return scores if isinstance(sample_or_samples, list) else scores[0]
