"""submit_batch and RewardBatch: the trainer's side of the data path.

validate -> plan chunks over the route -> group(score_chunk...) on per-backend queues
-> RewardBatch: poll results, put each outcome back at its input index, honour the deadline
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator, Sequence
from typing import Any, Literal

from celery import group
from celery.result import GroupResult

from .app import PRIORITIES, QrqCelery
from .routing import Chunk, plan
from .runtime import get_app
from .samples import Outcome, validate_samples
from .tasks import TASK_NAME

Priority = Literal["val", "train", "bulk"]
POLL_INTERVAL_S = 0.05


class RewardBatch:
    """Scores of one submitted batch, in input order.

    `get()` blocks until every sample has an outcome or the deadline passes (unfinished samples
    then come back as `timeout` with the fallback score); `await batch` does the same without
    blocking the event loop.

    Example:
        >>> batch = submit_batch([{"prompt": "2+2?", "response": "4"}], route="math")
        >>> batch.get()
        [1.0]
    """

    def __init__(
        self,
        app: QrqCelery,
        result: GroupResult | None,
        chunks: list[Chunk],
        outcomes: list[Outcome | None],
        deadline: float,
    ):
        self.app, self.result, self.deadline = app, result, deadline
        self._outcomes = outcomes
        self._pending = {
            r.id: c.indices for r, c in zip(result.results if result else [], chunks, strict=True)
        }

    def __len__(self) -> int:
        return len(self._outcomes)

    @property
    def id(self) -> str | None:
        return self.result.id if self.result else None

    @property
    def completed(self) -> int:
        """Samples with an outcome so far (polls once)."""
        self._poll()
        return sum(o is not None for o in self._outcomes)

    def done(self) -> bool:
        """True once every sample has an outcome (polls once, never blocks)."""
        self._poll()
        return not self._pending

    def outcomes(self, timeout: float | None = None) -> list[Outcome]:
        """Full outcome records in input order; see `get` for the waiting rules."""
        stop = self.deadline if timeout is None else min(self.deadline, time.time() + timeout)
        while True:
            self._poll()
            if not self._pending:
                break
            if time.time() >= self.deadline:
                self._expire()
                break
            if time.time() >= stop:
                raise TimeoutError(
                    f"{len(self._pending)} task(s) unfinished after {timeout} s "
                    f"(the batch deadline is later; call get() again)"
                )
            time.sleep(POLL_INTERVAL_S)
        return list(self._outcomes)  # type: ignore[arg-type]

    def get(self, timeout: float | None = None) -> list[float]:
        """Scores in input order; raises TimeoutError if `timeout` ends before the deadline."""
        return [o.score for o in self.outcomes(timeout)]

    scores = get

    def __await__(self) -> Generator[Any, None, list[float]]:
        return asyncio.get_running_loop().run_in_executor(None, self.get).__await__()

    def _poll(self) -> None:
        if not self._pending:
            return
        metas = self.app.backend.get_many(list(self._pending), interval=0, max_iterations=1)
        for task_id, meta in metas:
            self._settle(task_id, meta)

    def _settle(self, task_id: str, meta: dict) -> None:
        indices = self._pending.pop(task_id)
        status, result = meta["status"], meta.get("result")
        if status == "SUCCESS" and isinstance(result, list) and len(result) == len(indices):
            for i, data in zip(indices, result, strict=True):
                self._outcomes[i] = Outcome.from_dict(data)
            return
        fallback = self.app.qrq_config.fallback_score
        if status == "REVOKED":
            outcome = Outcome(fallback, "timeout", error="the task expired at the deadline")
        else:
            outcome = Outcome(fallback, "error", error=f"task {status}: {_describe(result)}")
        for i in indices:
            self._outcomes[i] = Outcome(**{**outcome.to_dict(), "id": None})

    def _expire(self) -> None:
        fallback = self.app.qrq_config.fallback_score
        for indices in self._pending.values():
            for i in indices:
                self._outcomes[i] = Outcome(
                    fallback, "timeout", error="no result by the batch deadline"
                )
        self._pending.clear()


def _describe(result: Any) -> str:
    if isinstance(result, dict) and "exc_type" in result:
        return f"{result['exc_type']}: {result.get('exc_message')}"
    return repr(result)[:300]


def submit_batch(
    samples: Sequence[dict],
    route: str | None = None,
    priority: Priority = "train",
    deadline_s: float | None = None,
    on_invalid: Literal["raise", "outcome"] = "raise",
    app: QrqCelery | None = None,
) -> RewardBatch:
    """Queue `samples` for scoring on `route`; returns at once with a RewardBatch.

    Invalid samples raise InvalidSamples (naming every bad index) before anything is queued,
    or with `on_invalid="outcome"` come back as `error` outcomes while the rest is scored.
    """
    app = app or get_app()
    config = app.qrq_config
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
    if on_invalid not in ("raise", "outcome"):
        raise ValueError(f"on_invalid must be 'raise' or 'outcome', got {on_invalid!r}")
    the_route = config.route(route)
    problems = validate_samples(samples, config.max_sample_bytes, on_invalid == "raise")
    outcomes: list[Outcome | None] = [
        Outcome(config.fallback_score, "error", error=f"invalid sample: {problems[i]}")
        if i in problems
        else None
        for i in range(len(samples))
    ]
    deadline = time.time() + (deadline_s if deadline_s is not None else config.deadline_s)
    chunks = plan(config, the_route, [i for i in range(len(samples)) if i not in problems])
    result = None
    if chunks:
        signatures = [
            app.signature(
                TASK_NAME,
                kwargs={
                    "backend": chunk.backend,
                    "samples": [samples[i] for i in chunk.indices],
                    "route": list(the_route.backends),
                    "deadline": deadline,
                },
            ).set(
                queue=config.backend(chunk.backend).queue,
                priority=PRIORITIES[priority],
                expires=deadline,
                argsrepr=f"({chunk.backend!r}, <{len(chunk.indices)} samples>)",
                kwargsrepr="{}",
            )
            for chunk in chunks
        ]
        with app.producer_or_acquire() as producer:
            result = group(signatures).apply_async(producer=producer)
    return RewardBatch(app, result, chunks, outcomes, deadline)


def score(
    samples: Sequence[dict],
    route: str | None = None,
    priority: Priority = "train",
    deadline_s: float | None = None,
    **kwargs: Any,
) -> list[float]:
    """Submit and wait: the scores of `samples` in input order."""
    return submit_batch(samples, route, priority, deadline_s, **kwargs).get()
