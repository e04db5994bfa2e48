"""Asyncio-native waiting on RewardBatch: no thread held per waiter, no timer.

The process's reader (collector.py) resolves a concurrent.futures.Future per waiter when the
batch is done (`RewardBatch.watch`); `asyncio.wrap_future` hands that to any event loop
(call_soon_threadsafe underneath), and threads can block on the same future. Cancelling one
waiter only drops that waiter; once every waiter of a batch is cancelled, nobody waits for it
and the batch is cancelled (a waiter that merely timed out is forgotten first, so the batch
goes on for whoever awaits it next).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import TYPE_CHECKING

from ..samples import Outcome

if TYPE_CHECKING:
    from .client import RewardBatch


def watch(batch: RewardBatch) -> Future[list[Outcome]]:
    """A concurrent.futures.Future resolved with `batch`'s outcomes by the process's reader;
    cancel it to stop waiting (the last waiter cancelled cancels the batch)."""
    future = batch.watch()

    def gone(done: Future[list[Outcome]]) -> None:
        if done.cancelled():
            batch.unwatch(done, cancel_if_last=True)

    future.add_done_callback(gone)
    return future


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
    batch.unwatch(watched, False)
    future.cancel()
    raise TimeoutError(
        f"batch unfinished after {timeout} s (the batch deadline is later; await it again)"
    )
