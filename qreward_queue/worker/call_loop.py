"""The process's call loop: one thread running an asyncio event loop, on which the calls of
every `awaitable` kind (the HTTP kinds) run, many at once, limited or not.

Why: a call on the call pool is a thread that sleeps in `recv` and wakes for the reply; at a
few thousand calls a second the switches between threads (and their fight for the GIL) cost
more CPU than the calls, and that CPU is taken from the judge on the same machine. On one
loop a reply costs no thread switch, and replies that arrive together are read together;
the limiter's round trips and waits are awaited on the same loop (`Limiter.*_async`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from collections.abc import Coroutine
from typing import Any, TypeVar

from .. import background
from ..backends import make_backend
from ..config.model import MAX_PROCESS_CALLS, Backend
from .call_pool import CallSizing

_T = TypeVar("_T")


GATHER_S = 0.01
# a call's reply this many times later than the backend's usual (and at least HEDGE_MIN_S)
# is a straggler worth a second call (CallPath's hedge)
HEDGE_FACTOR = 4.0
HEDGE_MIN_S = 1.0
LATENCY_WEIGHT = 0.05  # of each new reply's latency in the usual one (about the last 20)


class Slots:
    """A backend's calls in flight from this process, on the loop: `sizing.size` bounds them
    (a slot is taken before a grant is booked, so no lease waits idle), and replies' latency
    resizes them as it does the call pool's (used on the loop only)."""

    def __init__(self, sizing: CallSizing):
        self.sizing = sizing
        self.usual_s: float | None = None  # the backend's replies' latency, a running mean
        self._used = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def take(self, wanted: int) -> int:
        """Wait for one slot; with fewer than `wanted` (or a quarter of the slots) free, wait
        GATHER_S more; take what is free: the grants of calls started together are booked in
        one round trip, not one each."""
        try:
            while self._used >= self.sizing.size:
                waiter = asyncio.get_running_loop().create_future()
                self._waiters.append(waiter)
                await waiter
            if self.sizing.size - self._used < min(wanted, max(1, self.sizing.size // 4)):
                await asyncio.sleep(GATHER_S)
        except asyncio.CancelledError:
            self._wake()  # a slot this caller was woken for goes to the next waiter
            raise
        taken = max(0, min(wanted, self.sizing.size - self._used))
        self._used += taken
        return taken or await self.take(wanted)

    def give(self, count: int = 1) -> None:
        self._used -= count
        self._wake()

    def observe(self, latency_s: float) -> None:
        """One reply's latency: it may resize the slots."""
        w = LATENCY_WEIGHT
        self.usual_s = latency_s if self.usual_s is None else (1 - w) * self.usual_s + w * latency_s
        if self.sizing.observe(latency_s):
            self._wake()

    def hedge_after_s(self) -> float | None:
        """How long a call may wait for its reply before a second call is worth it (None:
        no reply seen yet, so nothing is usual)."""
        if self.usual_s is None:
            return None
        return max(HEDGE_MIN_S, HEDGE_FACTOR * self.usual_s)

    def _wake(self) -> None:
        free = self.sizing.size - self._used
        while self._waiters and free > 0:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                free -= 1


class CallLoop:
    """The event loop thread, and per backend the slots that hold its calls in flight to
    `[pool] calls` (sized from the limits unless the file sets it), as the call pool's
    threads do."""

    def __init__(self) -> None:
        self.loop = background.new_event_loop()
        # the threads of calls that must wait (a 429's Retry-After) or be split: made as needed
        self.loop.set_default_executor(
            concurrent.futures.ThreadPoolExecutor(MAX_PROCESS_CALLS, "qrq-call-wait"))
        self._slots: dict[str, Slots] = {}
        self._sizes: dict[str, CallSizing] = {}
        background.thread("qrq-call-loop", self.loop.run_forever)

    def run(self, coro: Coroutine[Any, Any, _T], timeout: float | None) -> _T | None:
        """Run `coro` on the loop and wait for its result, `timeout` at most (None then: it
        goes on, as calls past a deadline do, left to the retry policy); what it raises is
        raised here."""
        done = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return done.result(timeout)
        except concurrent.futures.TimeoutError:
            return None

    def slots(self, config: Backend) -> Slots:
        """The backend's calls in flight from this process (used on the loop only)."""
        if config.name not in self._slots:
            self._slots[config.name] = Slots(self._sizing(config))
        return self._slots[config.name]

    def _sizing(self, config: Backend) -> CallSizing:
        if config.name not in self._sizes:
            self._sizes[config.name] = CallSizing(config)
        return self._sizes[config.name]

    def sizes(self) -> dict[str, dict]:
        """Calls in flight per backend on the loop and why (shown by `qrq status`)."""
        return {name: {"calls": s.size, "why": f"{s.why}; on the call loop"}
                for name, s in list(self._sizes.items())}

    def connect(self, config: Backend) -> None:
        """Open the backend's kept-alive connections before the first task, as many as it may
        have calls in flight (a failure is left for the first call to meet)."""

        async def open_all() -> None:
            client = make_backend(config)
            await asyncio.gather(*(client.connect_async()
                                   for _ in range(self._sizing(config).size)))

        self.run(open_all(), timeout=None)


_loop = background.PerProcess(CallLoop)  # a forked child runs its own loop thread


def call_loop() -> CallLoop:
    return _loop.get()


def loop_sizes() -> dict[str, dict]:
    """This process's calls in flight per backend on the loop, if it has one."""
    loop = _loop.peek()
    return {} if loop is None else loop.sizes()
