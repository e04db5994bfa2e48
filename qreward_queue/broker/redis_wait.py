"""Waits on Redis that end when the caller's time does, and an outage said out loud.

Why: a frozen Redis (SIGSTOP, a stalled network path) answers nothing. A redis-py call then
waits out its socket timeout, and redis-py and Celery retry on timeout, so one read of the
client could take several socket timeouts and a batch returned seconds after its deadline.
`within` runs such a call on a small pool of helper threads and stops waiting when the time
given is spent (the abandoned call ends on its own later; its result is dropped).
`Outage` tells the trainer what is true meanwhile: Redis unreachable since when, retrying
until the deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import redis

from ..background import PerProcess

log = logging.getLogger("qreward_queue")
_T = TypeVar("_T")
HELPERS = 8  # helper threads; more stuck calls than this queue up and time out the same way
SAY_AGAIN_S = 10.0  # while Redis stays unreachable, say so again this often
_local = threading.local()


class RedisWaitTimeout(redis.TimeoutError):
    """Redis did not answer within the time the caller had left."""


def _new_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(HELPERS, thread_name_prefix="qrq-redis-wait",
                              initializer=setattr, initargs=(_local, "helper", True))


_pool = PerProcess(_new_pool)  # the parent's helper threads do not exist in a forked child


def submit(fn: Callable[[], _T]) -> Future[_T]:
    """Start `fn` (a call on Redis) on a helper thread; wait for it with `result`."""
    return _pool.get().submit(fn)


def result(future: Future[_T], seconds: float) -> _T:
    """`future`'s result, waiting at most `seconds`; RedisWaitTimeout after that (the call
    goes on and can be waited for again)."""
    try:
        return future.result(timeout=max(0.0, seconds))
    except TimeoutError:
        raise RedisWaitTimeout(f"Redis did not answer within {seconds:.1f} s") from None


def within(seconds: float, fn: Callable[[], _T]) -> _T:
    """`fn()` (a call on Redis, retries included), waited for at most `seconds`; run in place
    when already on a helper thread (the outer wait bounds it)."""
    if getattr(_local, "helper", False):
        return fn()
    future = submit(fn)
    try:
        return result(future, seconds)
    except RedisWaitTimeout:
        future.cancel()  # not started yet (every helper busy): never start it
        raise


class Outage:
    """Says when Redis stops answering a batch's polls, every SAY_AGAIN_S while it stays
    so, and when it answers again."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.since: float | None = None
        self._said = 0.0

    def noticed(self, exc: BaseException, deadline: float, since: float) -> None:
        """A read that began at `since` (epoch seconds) failed with `exc`."""
        now = time.time()
        if self.since is None:
            self.since = since
        if now - self._said < SAY_AGAIN_S:
            return
        self._said = now
        log.warning(
            "qrq: warning: Redis at %s unreachable since %s (%.0f s: %s); retrying until the "
            "batch deadline at %s (in %.0f s)",
            self.where, _clock(self.since), now - self.since,
            str(exc).strip() or type(exc).__name__, _clock(deadline), max(0.0, deadline - now),
        )

    def over(self) -> None:
        if self.since is not None:
            log.warning("qrq: Redis at %s answers again after %.1f s unreachable",
                        self.where, time.time() - self.since)
            self.since, self._said = None, 0.0


def _clock(epoch: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(epoch))
