"""Asyncio-native waiting on RewardBatch: one poller thread per process, not one per batch.

`await batch` used to park a default-executor thread per batch; with verl's per-sample calls
that capped concurrency at the executor's size. Here a single daemon thread polls every
outstanding batch with its non-blocking `done()` and resolves a concurrent.futures.Future per
waiter; `asyncio.wrap_future` hands that to any event loop (call_soon_threadsafe underneath),
and threads can block on the same future. Cancelling one waiter only drops that waiter; once
every waiter of a batch is cancelled, nobody waits for it and the batch is cancelled (a waiter
that merely timed out is forgotten first, so the batch goes on for whoever awaits it next).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import Future, InvalidStateError
from typing import TYPE_CHECKING

from ..samples import Outcome

if TYPE_CHECKING:
    from .client import RewardBatch

POLL_INTERVAL_S = 0.05  # as RewardBatch.outcomes() polls: one MGET per batch per round


class _Poller:
    """The process-wide poller: batches being waited on -> the futures of their waiters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._watched: dict[int, tuple[RewardBatch, list[Future[list[Outcome]]]]] = {}
        self._thread: threading.Thread | None = None

    def watch(self, batch: RewardBatch) -> Future[list[Outcome]]:
        future: Future[list[Outcome]] = Future()
        with self._lock:
            self._watched.setdefault(id(batch), (batch, []))[1].append(future)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="qrq-aio-poller",
                                                daemon=True)
                self._thread.start()
        self._wake.set()
        return future

    def _run(self) -> None:
        while True:
            with self._lock:
                watched = list(self._watched.items())
            if not watched:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            started = time.monotonic()
            for key, (batch, futures) in watched:
                self._check(key, batch, futures)
            time.sleep(max(0.0, POLL_INTERVAL_S - (time.monotonic() - started)))

    def forget(self, batch: RewardBatch, future: Future[list[Outcome]]) -> None:
        """Stop resolving `future` without counting it as a cancelled waiter."""
        with self._lock:
            futures = self._watched.get(id(batch), (batch, []))[1]
            if future in futures:
                futures.remove(future)

    def _check(self, key: int, batch: RewardBatch, futures: list[Future[list[Outcome]]]) -> None:
        with self._lock:
            live = [f for f in futures if not f.done()]
            if not live:  # every waiter was cancelled (or forgotten): stop polling this batch
                self._watched.pop(key, None)
        if not live:
            if futures:  # nobody waits for the batch any more
                batch.cancel()
            return
        try:
            if not (batch.done() or time.time() >= batch.deadline):
                return
            result: list[Outcome] | BaseException = batch.outcomes()  # done: returns at once
        except Exception as exc:  # e.g. the result store refused; every waiter learns why
            result = exc
        with self._lock:
            self._watched.pop(key, None)
        for future in futures:
            _resolve(future, result)


def _resolve(future: Future[list[Outcome]], result: list[Outcome] | BaseException) -> None:
    try:
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
    except InvalidStateError:  # cancelled meanwhile
        pass


_poller = _Poller()


def _reset_after_fork() -> None:
    global _poller
    _poller = _Poller()  # the parent's thread does not exist in the child


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def watch(batch: RewardBatch) -> Future[list[Outcome]]:
    """A concurrent.futures.Future resolved with `batch`'s outcomes (or its error) by the
    process's poller thread; cancel it to stop waiting."""
    return _poller.watch(batch)


async def outcomes(batch: RewardBatch, timeout: float | None = None) -> list[Outcome]:
    """Await `batch`'s outcomes without holding a thread; TimeoutError after `timeout` s."""
    watched = watch(batch)
    future = asyncio.wrap_future(watched)
    if timeout is None:
        return await future
    try:
        done, _ = await asyncio.wait({future}, timeout=timeout)
    except asyncio.CancelledError:  # the awaiter was cancelled: so is its waiter
        future.cancel()
        raise
    if done:
        return future.result()
    _poller.forget(batch, watched)
    future.cancel()
    raise TimeoutError(
        f"batch unfinished after {timeout} s (the batch deadline is later; await it again)"
    )
