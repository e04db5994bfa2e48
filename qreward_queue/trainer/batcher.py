"""A per-process micro-batcher: many concurrent one-sample calls -> one submit_batch per flush.

verl, slime, AReaL and the gateway score one sample at a time from many coroutines. A
submit_batch per sample would cost a Celery group and a result poll each; here calls queue up
per (route, priority, deadline, job) and one flusher thread sends each queue as one batch when it
holds `max_items` samples or its oldest sample has waited `max_wait_ms`. Outcomes come back
through the process's one reader (collector.py), so callers on any event loop, or plain
threads, hold no thread while they wait; each caller gets its outcome as soon as its own
sample is scored, not when the whole batch is. Routes and priorities are never mixed in one
batch. With `max_in_flight`, a batcher that has that many batches out holds new samples
until one of them ends (or `max_hold_ms` passes, or a queue is full): under a load the workers
cannot take one sample at a time, batches grow instead of queueing up, since each batch
costs a task's bookkeeping whatever its size. A batch that nobody waits for any more (its
callers served or cancelled, one at least cancelled) is cancelled too; while one of them
still waits, it goes on.

On a route whose judges score whole groups (`mode = "group"`), a caller's sample is held
until its group is complete, then the group joins the queue whole and no flush cuts it: its
group is its `group` key, else its prompt; complete is `group_size` samples (a key of the
sample, else the batcher's `group_size`), or, with no size known or a caller that never comes,
whatever arrived within `group_wait_ms` of the group's first sample. Groups are assembled per
process: a trainer whose one group's callers are spread over several processes gets parts of
groups judged (each after the wait), never a wrong score.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from ..background import Daemon, PerProcess
from ..planning.routing import grouped, pack
from ..priority import Priority
from ..samples import Outcome
from . import aio
from .client import submit_batch
from .runtime import get_app

_Key = tuple[str | None, Priority, float | None, str | None]  # route, priority, deadline, job
_Item = tuple[dict[str, Any], Future[Outcome]]


@dataclass
class _Held:
    """A group's samples so far, held until it has `size` (None: unknown) or waited enough."""

    opened: float
    size: int | None
    items: list[_Item] = field(default_factory=list)


@dataclass
class _Queue:
    ready_since: float | None = None  # when the oldest unit ready to send came
    units: list[list[_Item]] = field(default_factory=list)  # a sample, or a whole group
    held: dict[tuple[str, Any], _Held] = field(default_factory=dict)

    @property
    def ready(self) -> int:
        return sum(map(len, self.units))

    def add(self, unit: list[_Item], now: float) -> None:
        self.units.append(unit)
        self.ready_since = self.ready_since or now


class MicroBatcher:
    """Gathers concurrent single-sample calls into batches.

    Example:
        >>> batcher = MicroBatcher(max_items=64, max_wait_ms=20)
        >>> outcome = await batcher.score({"prompt": "2+2?", "response": "4"}, route="math")
        >>> outcome.score
        1.0

    Args:
        max_items: a queue is sent as soon as it holds this many samples (whole groups: a
            larger group goes alone).
        max_wait_ms: ...or when its oldest sample has waited this long.
        group_wait_ms: on a group-mode route, the longest a group is held for its missing
            samples; then what arrived is sent.
        group_size: on a group-mode route, the samples of a complete group when the sample
            does not say (`group_size`); None: each group waits `group_wait_ms`.
        max_in_flight: with this many batches out (sent, not ended), a queue waits for one
            to end before it is sent, up to `max_hold_ms` (None: no such wait).
        max_hold_ms: the longest that wait lasts, from the queue's oldest sample.
    """

    def __init__(self, max_items: int = 64, max_wait_ms: float = 20.0,
                 group_wait_ms: float = 2000.0, group_size: int | None = None,
                 max_in_flight: int | None = None, max_hold_ms: float = 50.0):
        if max_items < 1 or max_wait_ms < 0 or group_wait_ms < 0 or (group_size or 1) < 1 \
                or (max_in_flight or 1) < 1 or max_hold_ms < 0:
            raise ValueError("max_items, group_size and max_in_flight must be >= 1, "
                             "max_wait_ms, group_wait_ms and max_hold_ms >= 0")
        self.max_items, self.max_wait_s = max_items, max_wait_ms / 1000
        self.group_wait_s, self.group_size = group_wait_ms / 1000, group_size
        self.max_in_flight, self.max_hold_s = max_in_flight, max(max_hold_ms, max_wait_ms) / 1000
        self._grouped: dict[str | None, bool] = {}
        self._start_fresh()

    def _start_fresh(self) -> None:
        """New lock, queues and thread: at creation, and in a forked child (whose copy of the
        parent's lock may be held and whose queued callers live in the parent)."""
        self.batches_sent = 0
        self.in_flight = 0  # batches sent and not ended
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._queues: dict[_Key, _Queue] = {}
        self._thread = Daemon("qrq-microbatcher", self._run)

    def submit(
        self,
        sample: dict[str, Any],
        route: str | None = None,
        priority: Priority | str = Priority.TRAIN,
        deadline_s: float | None = None,
        job: str | None = None,
    ) -> Future[Outcome]:
        """Queue one sample (of `job`: see submit_batch); the returned Future resolves to its
        Outcome."""
        future: Future[Outcome] = Future()
        key = (route, Priority.parse(priority), deadline_s, job)  # a bad name fails here
        if self._pid != os.getpid():
            self._start_fresh()
        group = self._group_of(sample, route)
        with self._cond:
            now, queue = time.monotonic(), self._queues.setdefault(key, _Queue())
            if group is None:
                queue.add([(sample, future)], now)
            else:
                held = queue.held.get(group)
                if held is None:
                    size = sample.get("group_size") or self.group_size
                    held = queue.held[group] = _Held(now, size)
                    self._cond.notify()  # the flusher learns of the group's wait
                held.items.append((sample, future))
                if held.size is not None and len(held.items) >= held.size:  # complete
                    queue.add(queue.held.pop(group).items, now)
            self._thread.ensure()
            if queue.ready_since == now or queue.ready >= self.max_items:
                self._cond.notify()
        return future

    def _group_of(self, sample: Any, route: str | None) -> tuple[str, Any] | None:
        """The group `sample` is held in (by `group`, else prompt), None: sent on its own."""
        if not isinstance(sample, dict) or not self._route_grouped(route):
            return None
        if sample.get("group") is not None:
            return "group", sample["group"]
        return "prompt", sample.get("prompt")

    def _route_grouped(self, route: str | None) -> bool:
        if route not in self._grouped:
            try:
                config = get_app().qrq_config
                self._grouped[route] = grouped(config, config.route(route))
            except Exception:  # no config, an unknown route: submit_batch says why, per caller
                return False
        return self._grouped[route]

    async def score(
        self,
        sample: dict[str, Any],
        route: str | None = None,
        priority: Priority | str = Priority.TRAIN,
        deadline_s: float | None = None,
        job: str | None = None,
    ) -> Outcome:
        """Score one sample from any event loop; cancelling this call affects no other."""
        return await asyncio.wrap_future(self.submit(sample, route, priority, deadline_s, job))

    async def score_many(
        self,
        samples: Sequence[dict[str, Any]],
        route: str | None = None,
        priority: Priority | str | Sequence[Priority | str] = Priority.TRAIN,
        deadline_s: float | None = None,
        job: str | None = None,
    ) -> list[Outcome]:
        """Score samples (one priority, or one per sample) through the same queues."""
        priorities = [priority] * len(samples) if isinstance(priority, str) else list(priority)
        futures = [self.submit(s, route, p, deadline_s, job)
                   for s, p in zip(samples, priorities, strict=True)]
        return list(await asyncio.gather(*map(asyncio.wrap_future, futures)))

    # -- the flusher thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                due = self._take_due()
                while not due:
                    self._cond.wait(self._next_wait())
                    due = self._take_due()
            for key, items in due:
                self._send(key, items)

    def _next_wait(self) -> float | None:
        wait_s = self._wait_s()
        times = [t for q in self._queues.values()
                 for t in ([q.ready_since + wait_s] if q.ready_since else [])
                 + [held.opened + self.group_wait_s for held in q.held.values()]]
        return max(0.0, min(times) - time.monotonic()) if times else None

    def _wait_s(self) -> float:
        """How long a queue's oldest sample waits for more: longer while the batches out are
        as many as allowed (one ending wakes the flusher)."""
        full = self.max_in_flight is not None and self.in_flight >= self.max_in_flight
        return self.max_hold_s if full else self.max_wait_s

    def _take_due(self) -> list[tuple[_Key, list[_Item]]]:
        now, due, wait_s = time.monotonic(), [], self._wait_s()
        for key, queue in list(self._queues.items()):
            for group, held in list(queue.held.items()):
                if now - held.opened >= self.group_wait_s:  # waited enough: what it has
                    queue.add(queue.held.pop(group).items, now)
            since = queue.ready_since
            if queue.ready >= self.max_items or (since and now - since >= wait_s):
                units = [[(s, f) for s, f in unit if not f.cancelled()] for unit in queue.units]
                batches = [(key, items) for items in pack([u for u in units if u],
                                                          self.max_items)]
                self.in_flight += len(batches)
                due += batches
                queue.units, queue.ready_since = [], None
            if not queue.units and not queue.held:
                del self._queues[key]
        return due

    def _send(self, key: _Key, items: list[_Item]) -> None:
        route, priority, deadline_s, job = key
        try:
            batch = submit_batch([s for s, _ in items], route=route, priority=priority,
                                 deadline_s=deadline_s, on_invalid="outcome", job=job)
        except Exception as exc:  # e.g. an unknown route, Redis down: every caller learns why
            self._ended()
            for _, future in items:
                _settle(future, exc)
            return
        self.batches_sent += 1
        batch.on_outcome(lambda i, outcome: _settle(items[i][1], outcome))
        watched = aio.watch(batch)
        watched.add_done_callback(lambda done: self._over(done, items))

        ended = itertools.count(1)  # next() is atomic: callers end on several threads

        def caller_gone(_: Future[Outcome]) -> None:  # the last caller gone: nobody waits any more
            if next(ended) == len(items) and any(f.cancelled() for _, f in items):
                watched.cancel()

        for _, future in items:
            future.add_done_callback(caller_gone)

    def _over(self, done: Future[list[Outcome]], items: list[_Item]) -> None:
        self._ended()
        _distribute(done, items)

    def _ended(self) -> None:
        """A batch is over: the queues held for it may go."""
        with self._cond:
            self.in_flight -= 1
            self._cond.notify()


def _distribute(done: Future[list[Outcome]], items: list[_Item]) -> None:
    """The batch is over: whoever still waits learns its outcome (or the batch's error)."""
    if done.cancelled():  # every caller was served or cancelled: nobody to tell
        return
    error = done.exception()
    outcomes: Sequence[Outcome | BaseException] = (
        done.result() if error is None else [error] * len(items))
    for (_, future), outcome in zip(items, outcomes, strict=True):
        _settle(future, outcome)


def _settle(future: Future[Outcome], value: Outcome | BaseException) -> None:
    try:
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)
    except InvalidStateError:  # the caller gave up (cancelled) meanwhile
        pass


def _from_env() -> MicroBatcher:
    env = os.environ.get
    return MicroBatcher(int(env("QRQ_BATCH_MAX_ITEMS", 64)),
                        float(env("QRQ_BATCH_MAX_WAIT_MS", 20)),
                        float(env("QRQ_BATCH_GROUP_WAIT_MS", 2000)),
                        int(env("QRQ_BATCH_GROUP_SIZE", 0)) or None)


_batcher = PerProcess(_from_env)


def default_batcher() -> MicroBatcher:
    """This process's batcher (a forked child gets its own; settings from QRQ_BATCH_MAX_ITEMS,
    QRQ_BATCH_MAX_WAIT_MS, QRQ_BATCH_GROUP_WAIT_MS and QRQ_BATCH_GROUP_SIZE)."""
    return _batcher.get()


async def score_one(
    sample: dict[str, Any],
    route: str | None = None,
    priority: Priority | str = Priority.TRAIN,
    deadline_s: float | None = None,
) -> Outcome:
    """Score one sample through this process's micro-batcher (await it from any loop)."""
    return await default_batcher().score(sample, route, priority, deadline_s)


def score_one_sync(
    sample: dict[str, Any],
    route: str | None = None,
    priority: Priority | str = Priority.TRAIN,
    deadline_s: float | None = None,
) -> Outcome:
    """score_one for threads: blocks the calling thread until the outcome is in."""
    return default_batcher().submit(sample, route, priority, deadline_s).result()
