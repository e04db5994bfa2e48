"""submit_batch and RewardBatch: the trainer's side of the data path.

validate -> dedup -> cache lookup -> plan chunks over the route (weight x free capacity)
-> group(score_chunk...) on per-backend priority queues
-> RewardBatch: poll results, put each outcome back at its input index(es), cache new scores,
   resubmit work that will never come back, and honour the deadline
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Generator, Sequence
from dataclasses import replace
from typing import Any, Literal

import redis
from celery import group
from celery.states import READY_STATES

from . import metrics
from .app import PRIORITIES, QrqCelery
from .cache import ScoreCache, content_key, reward_identity
from .config import Route
from .routing import Chunk, plan, route_shares
from .runtime import get_app
from .samples import Outcome, validate_samples
from .status import queue_depth
from .tasks import TASK_NAME

Priority = Literal["val", "train", "bulk"]
POLL_INTERVAL_S = 0.05
LIVENESS_CHECK_S = 2.0


class RewardBatch:
    """Scores of one submitted batch, in input order.

    `get()` blocks until every sample has an outcome or the deadline passes (unfinished samples
    then come back as `timeout` with the fallback score); `await batch` does the same without
    blocking the event loop. Results that will never come (Redis lost its data, the worker
    running a task died) are noticed and the work is sent again before the deadline.

    Example:
        >>> batch = submit_batch([{"prompt": "2+2?", "response": "4"}], route="math")
        >>> batch.get()
        [1.0]
    """

    def __init__(
        self,
        app: QrqCelery,
        route: Route,
        samples: Sequence[dict],
        outcomes: list[Outcome | None],
        copies: dict[int, list[int]],
        cache: ScoreCache | None,
        priority: int,
        deadline: float,
    ):
        self.app, self.route, self.samples = app, route, samples
        self.priority, self.deadline, self.cache = priority, deadline, cache
        self._outcomes, self._copies = outcomes, copies
        self._pending: dict[str, Chunk] = {}
        self._sentinel: str | None = None
        self._next_liveness_check = time.monotonic() + LIVENESS_CHECK_S
        self._unheld: set[str] = set()
        self.resubmitted = 0

    def __len__(self) -> int:
        return len(self._outcomes)

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

    # -- sending -------------------------------------------------------------------------------

    def send(self, chunks: list[Chunk]) -> None:
        """Publish one score_chunk task per chunk and remember which indices it answers."""
        if not chunks:
            return
        config = self.app.qrq_config
        signatures = [
            self.app.signature(
                TASK_NAME,
                kwargs={
                    "backend": c.backend,
                    "samples": [self.samples[i] for i in c.indices],
                    "route": list(self.route.backends),
                    "deadline": self.deadline,
                },
            ).set(
                queue=config.backend(c.backend).queue,
                priority=self.priority,
                expires=max(1.0, self.deadline - time.time()),
                argsrepr=f"({c.backend!r}, <{len(c.indices)} samples>)",
                kwargsrepr="{}",
            )
            for c in chunks
        ]
        with self.app.producer_or_acquire() as producer:
            result = group(signatures).apply_async(producer=producer)
        self._pending.update(zip((r.id for r in result.results), chunks, strict=True))
        if not config.embedded:
            # Redis losing its data (a restart without persistence) takes this key with it.
            self._sentinel = f"qrq:batch:{result.id}"
            ttl_ms = int((self.deadline - time.time() + 60) * 1000)
            self.app.store.set(self._sentinel, 1, px=max(ttl_ms, 1000))

    # -- collecting ----------------------------------------------------------------------------

    def _poll(self) -> None:
        if not self._pending:
            return
        try:
            metas = self._read_metas()
            lost = self._lost_chunks(metas)
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return  # Redis is restarting: try again at the next poll, until the deadline
        for task_id, meta in metas.items():
            if meta["status"] in READY_STATES:
                self._settle(self._pending.pop(task_id), meta)
        if lost and time.time() < self.deadline:
            for task_id in lost:
                self._pending.pop(task_id, None)
            self.resubmitted += len(lost)
            self.send(list(lost.values()))

    def _read_metas(self) -> dict[str, dict]:
        backend = self.app.backend
        keys = {backend.get_key_for_task(i): i for i in self._pending}
        values = backend.mget(list(keys))
        if not isinstance(values, dict):  # Redis answers a list, the in-memory cache a dict
            values = dict(zip(keys, values, strict=True))
        return {keys[k]: backend.decode_result(v) for k, v in values.items() if v}

    def _lost_chunks(self, metas: dict[str, dict]) -> dict[str, Chunk]:
        """Tasks whose result will never come: all of them when Redis lost the batch's
        sentinel; those held (running, or waiting out a retry) by a worker whose heartbeat
        lapsed; and those nobody holds while every queue of the route is empty (a message
        lost between a worker's pop and its bookkeeping), seen so at two checks in a row."""
        if self.app.qrq_config.embedded or time.monotonic() < self._next_liveness_check:
            return {}
        self._next_liveness_check = time.monotonic() + LIVENESS_CHECK_S
        store = self.app.store
        if self._sentinel and not store.exists(self._sentinel):
            return {i: c for i, c in self._pending.items() if i not in metas}
        waiting = [i for i in self._pending if i not in metas]
        holders = dict(zip(waiting, store.mget([f"qrq:held:{i}" for i in waiting]), strict=True))
        hosts = sorted({h for h in holders.values() if h})
        alive = dict(
            zip(hosts, store.mget([f"qrq:alive:{h.decode()}" for h in hosts]), strict=True)
        )
        lost = {i: self._pending[i] for i, h in holders.items() if h and not alive[h]}
        unheld = {i for i, h in holders.items() if not h}
        if unheld and not any(
            queue_depth(store, self.app.backend_config(b).queue) for b in self.route.backends
        ):
            lost.update({i: self._pending[i] for i in unheld & self._unheld})
            self._unheld = unheld
        else:
            self._unheld = set()
        return lost

    def _settle(self, chunk: Chunk, meta: dict) -> None:
        status, result = meta["status"], meta.get("result")
        fallback = self.app.qrq_config.fallback_score
        if status == "SUCCESS" and isinstance(result, list) and len(result) == len(chunk.indices):
            outcomes = [Outcome.from_dict(d) for d in result]
        elif status == "REVOKED":
            outcomes = [
                Outcome(fallback, "timeout", error="the task expired at the deadline")
                for _ in chunk.indices
            ]
        else:
            outcomes = [
                Outcome(fallback, "error", error=f"task {status}: {_describe(result)}")
                for _ in chunk.indices
            ]
        fresh = {}
        for i, outcome in zip(chunk.indices, outcomes, strict=True):
            for j in [i, *self._copies.get(i, ())]:
                self._outcomes[j] = Outcome(
                    **{**outcome.to_dict(), "id": self.samples[j].get("id")}
                )
            if outcome.status == "ok":
                fresh[content_key(self.samples[i])] = outcome
        if self.cache and fresh:
            self.cache.put_many(fresh)

    def _expire(self) -> None:
        fallback = self.app.qrq_config.fallback_score
        for chunk in self._pending.values():
            for i in chunk.indices:
                for j in [i, *self._copies.get(i, ())]:
                    self._outcomes[j] = Outcome(
                        fallback,
                        "timeout",
                        id=self.samples[j].get("id"),
                        error="no result by the batch deadline",
                    )
        self._pending.clear()


def _describe(result: Any) -> str:
    if isinstance(result, dict) and "exc_type" in result:
        return f"{result['exc_type']}: {result.get('exc_message')}"
    return json.dumps(result, default=str)[:300]


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
    Identical samples are scored once; with the route's cache on, known scores come back
    as `cached` without touching a queue.
    """
    app = app or get_app()
    config = app.qrq_config
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
    if on_invalid not in ("raise", "outcome"):
        raise ValueError(f"on_invalid must be 'raise' or 'outcome', got {on_invalid!r}")
    the_route = config.route(route)
    problems = validate_samples(samples, config.max_sample_bytes, on_invalid == "raise")
    outcomes: list[Outcome | None] = [None] * len(samples)
    for i, why in problems.items():
        outcomes[i] = Outcome(
            config.fallback_score, "error", id=_id(samples[i]), error=f"invalid sample {i}: {why}"
        )
    first: dict[str, int] = {}
    copies: dict[int, list[int]] = {}
    for i in range(len(samples)):
        if i not in problems:
            key = content_key(samples[i])
            if key in first:
                copies.setdefault(first[key], []).append(i)
            else:
                first[key] = i
    cache = (
        ScoreCache(app.store, reward_identity(config, the_route), the_route.cache_ttl_s)
        if the_route.cache
        else None
    )
    hits = cache.get_many(list(first)) if cache else {}
    if cache:
        metrics.record_cache(app.store, the_route.name, len(first), len(hits))
    for key, outcome in hits.items():
        for j in [first[key], *copies.get(first[key], ())]:
            outcomes[j] = replace(outcome, id=_id(samples[j]))
    todo = [i for key, i in first.items() if key not in hits]
    deadline = time.time() + (deadline_s if deadline_s is not None else config.deadline_s)
    batch = RewardBatch(
        app, the_route, samples, outcomes, copies, cache, PRIORITIES[priority], deadline
    )
    batch.send(plan(config, the_route, todo, route_shares(app, the_route, len(todo))))
    return batch


def _id(sample: Any) -> Any:
    return sample.get("id") if isinstance(sample, dict) else None


def score(
    samples: Sequence[dict],
    route: str | None = None,
    priority: Priority = "train",
    deadline_s: float | None = None,
    **kwargs: Any,
) -> list[float]:
    """Submit and wait: the scores of `samples` in input order."""
    return submit_batch(samples, route, priority, deadline_s, **kwargs).get()
