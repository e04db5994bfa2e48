"""What a route does with its judges' outcomes beyond placing them: its `on_injection` policy
and its audit lane. The two hooks RewardBatch calls, kept apart from the client's own work.

    on_injection(route, outcome)   as the outcome arrives: "zero" scores a flagged one 0
    after_batch(app, route, samples, outcomes)   once every outcome is in: starts the audit
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import redis

from ..config.model import Route
from ..ops import audit
from ..samples import Outcome, flagged

if TYPE_CHECKING:
    from ..broker.app import QrqCelery

log = logging.getLogger(__name__)
_lock = threading.Lock()
_auditors: ThreadPoolExecutor | None = None


Submit = Callable[..., Any]  # the client's submit_batch (the client imports this module)


def on_injection(route: Route, outcome: Outcome) -> Outcome:
    """`outcome` under the route's policy: with "zero" a flagged score becomes 0, its detail
    saying what the judge gave. ("min" acts in the ensemble's aggregate, "score" flags only.)"""
    if route.on_injection != "zero" or outcome.status != "ok" or outcome.score is None \
            or not flagged(outcome.detail):
        return outcome
    note = f" [scored 0 by on_injection = \"zero\"; the judge gave {outcome.score:g}]"
    return Outcome(0.0, "ok", outcome.backend, outcome.attempts, outcome.latency_ms,
                   detail=(outcome.detail or "") + note)


def after_batch(app: QrqCelery, route: Route, samples: Sequence[dict[str, Any]],
                outcomes: Sequence[Outcome | None], submit: Submit) -> None:
    """Send the audit lane's share of the batch's `ok` outcomes to the audit route with
    `submit` (the client's `submit_batch`), on a background thread: the batch has returned
    and never waits for it."""
    lane = route.audit
    if lane is None:
        return
    picked = [(s, o.score) for s, o in zip(samples, outcomes, strict=True)
              if o is not None and o.status == "ok" and o.score is not None
              and audit.chosen(lane, s)]
    if picked:
        _executor().submit(_audit, app, route, picked, submit)


def _audit(app: QrqCelery, route: Route, picked: list[tuple[dict[str, Any], float]],
           submit_batch: Submit) -> None:
    lane = route.audit
    assert lane is not None
    try:
        samples = [{k: v for k, v in s.items() if k not in ("group", "group_size")}
                   for s, _ in picked]
        outcomes = submit_batch(samples, route=lane.route, priority="bulk", app=app).outcomes()
        pairs = [(s, score, o.score if o.scored else None)
                 for (s, score), o in zip(picked, outcomes, strict=True)]
        with contextlib.suppress(redis.RedisError, OSError):
            audit.record(app.store, route.name, lane, pairs)
    except Exception as exc:  # an audit never troubles the trainer: it says so and goes on
        log.warning("qrq: audit of route %r on %r failed: %s", route.name, lane.route, exc)


def _executor() -> ThreadPoolExecutor:
    global _auditors
    with _lock:
        if _auditors is None:
            _auditors = ThreadPoolExecutor(2, thread_name_prefix="qrq-audit")
        return _auditors
