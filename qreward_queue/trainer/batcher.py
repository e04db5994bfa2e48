"""A per-process micro-batcher: many concurrent one-sample calls -> one submit_batch per flush.

verl, slime, AReaL and the gateway score one sample at a time from many coroutines. A
submit_batch per sample would cost a Celery group and a result poll each; here calls queue up
per (route, priority, deadline) and one flusher thread sends each queue as one batch when it
holds `max_items` samples or its oldest sample has waited `max_wait_ms`. Outcomes come back
through the process's aio poller, so callers on any event loop, or plain threads, hold no
thread while they wait; each caller gets its outcome as soon as its own sample is scored, not
when the whole batch is. Routes and priorities are never mixed in one batch. A batch that
nobody waits for any more (its callers served or cancelled, one at least cancelled) is
cancelled too; while one of them still waits, it goes on.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from ..priority import Priority
from ..samples import Outcome
from . import aio
from .client import submit_batch

_Key = tuple[str | None, Priority, float | None]
_Item = tuple[dict[str, Any], Future[Outcome]]


@dataclass
class _Queue:
    opened: float
    items: list[_Item] = field(default_factory=list)


class MicroBatcher:
    """Gathers concurrent single-sample calls into batches.

    Example:
        >>> batcher = MicroBatcher(max_items=64, max_wait_ms=20)
        >>> outcome = await batcher.score({"prompt": "2+2?", "response": "4"}, route="math")
        >>> outcome.score
        1.0

    Args:
        max_items: a queue is sent as soon as it holds this many samples.
        max_wait_ms: ...or when its oldest sample has waited this long.
    """

    def __init__(self, max_items: int = 64, max_wait_ms: float = 20.0):
        if max_items < 1 or max_wait_ms < 0:
            raise ValueError("max_items must be >= 1 and max_wait_ms >= 0")
        self.max_items, self.max_wait_s = max_items, max_wait_ms / 1000
        self._start_fresh()

    def _start_fresh(self) -> None:
        """New lock, queues and thread: at creation, and in a forked child (whose copy of the
        parent's lock may be held and whose queued callers live in the parent)."""
        self.batches_sent = 0
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._queues: dict[_Key, _Queue] = {}
        self._thread: threading.Thread | None = None

    def submit(
        self,
        sample: dict[str, Any],
        route: str | None = None,
        priority: Priority | str = Priority.TRAIN,
        deadline_s: float | None = None,
    ) -> Future[Outcome]:
        """Queue one sample; the returned Future resolves to its Outcome."""
        future: Future[Outcome] = Future()
        key = (route, Priority.parse(priority), deadline_s)  # a bad name fails here, not later
        if self._pid != os.getpid():
            self._start_fresh()
        with self._cond:
            queue = self._queues.setdefault(key, _Queue(time.monotonic()))
            queue.items.append((sample, future))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="qrq-microbatcher",
                                                daemon=True)
                self._thread.start()
            if len(queue.items) == 1 or len(queue.items) >= self.max_items:
                self._cond.notify()
        return future

    async def score(
        self,
        sample: dict[str, Any],
        route: str | None = None,
        priority: Priority | str = Priority.TRAIN,
        deadline_s: float | None = None,
    ) -> Outcome:
        """Score one sample from any event loop; cancelling this call affects no other."""
        return await asyncio.wrap_future(self.submit(sample, route, priority, deadline_s))

    async def score_many(
        self,
        samples: Sequence[dict[str, Any]],
        route: str | None = None,
        priority: Priority | str | Sequence[Priority | str] = Priority.TRAIN,
        deadline_s: float | None = None,
    ) -> list[Outcome]:
        """Score samples (one priority, or one per sample) through the same queues."""
        priorities = [priority] * len(samples) if isinstance(priority, str) else list(priority)
        futures = [self.submit(s, route, p, deadline_s) for s, p in zip(samples, priorities,
                                                                        strict=True)]
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
        if not self._queues:
            return None
        oldest = min(q.opened for q in self._queues.values())
        return max(0.0, oldest + self.max_wait_s - time.monotonic())

    def _take_due(self) -> list[tuple[_Key, list[_Item]]]:
        now, due = time.monotonic(), []
        for key, queue in list(self._queues.items()):
            if len(queue.items) >= self.max_items or now - queue.opened >= self.max_wait_s:
                del self._queues[key]
                items = [(s, f) for s, f in queue.items if not f.cancelled()]
                due += [(key, items[i:i + self.max_items])
                        for i in range(0, len(items), self.max_items)]
        return due

    def _send(self, key: _Key, items: list[_Item]) -> None:
        route, priority, deadline_s = key
        try:
            batch = submit_batch([s for s, _ in items], route=route, priority=priority,
                                 deadline_s=deadline_s, on_invalid="outcome")
        except Exception as exc:  # e.g. an unknown route, Redis down: every caller learns why
            for _, future in items:
                _settle(future, exc)
            return
        self.batches_sent += 1
        batch.on_outcome(lambda i, outcome: _settle(items[i][1], outcome))
        watched = aio.watch(batch)
        watched.add_done_callback(lambda done: _distribute(done, items))

        def caller_gone(_: Future[Outcome]) -> None:  # the last caller gone: nobody waits any more
            futures = [f for _, f in items]
            if all(f.done() for f in futures) and any(f.cancelled() for f in futures):
                watched.cancel()

        for _, future in items:
            future.add_done_callback(caller_gone)


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


_batcher: MicroBatcher | None = None
_lock = threading.Lock()


def default_batcher() -> MicroBatcher:
    """This process's batcher (a forked child gets its own; settings from QRQ_BATCH_MAX_ITEMS
    and QRQ_BATCH_MAX_WAIT_MS)."""
    global _batcher
    with _lock:
        if _batcher is None:
            _batcher = MicroBatcher(int(os.environ.get("QRQ_BATCH_MAX_ITEMS", 64)),
                                    float(os.environ.get("QRQ_BATCH_MAX_WAIT_MS", 20)))
        return _batcher


def _forget_after_fork() -> None:
    global _batcher, _lock
    _batcher, _lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


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
