"""The calls in flight from this process to each backend, shared by all its running tasks:
how many (`CallSizing`), the threads that make them (`CallPool`), and one chunk's share of
them (`InFlight`)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from .. import background
from ..backends import make_backend
from ..config.model import MAX_PROCESS_CALLS, PROCESS_CALLS, Backend, advised_calls


class CallSizing:
    """How many calls one process keeps in flight to a backend, and why.

    `[pool] calls` in the file: that many. Without it, rate x latency (Little's law, as
    `advised_calls` sizes it) once the backend has an rpm and replies have shown its latency,
    bounded by `max_concurrent` and MAX_PROCESS_CALLS (`pool.calls` then holds that bound);
    until then, and with no rpm, PROCESS_CALLS (or max_concurrent, when lower). The global
    limiter still holds the whole backend to its limits: this only decides how many calls a
    process has ready for it.
    """

    LATENCY_WEIGHT = 0.05  # of each new latency in the running mean (about the last 20 calls)

    def __init__(self, config: Backend):
        self.limits, self.most = config.limits, config.pool.calls
        self.sized = config.pool.sized
        self.latency_s: float | None = None
        if not self.sized:
            self.size, self.why = self.most, "[pool] calls in the backend file"
        elif self.most < PROCESS_CALLS:
            self.size, self.why = self.most, f"max_concurrent = {self.most}"
        else:
            self.size = PROCESS_CALLS
            self.why = ("no latency seen yet" if self.limits.rpm else
                        f"no rpm or max_concurrent: {PROCESS_CALLS}, an asyncio client's usual")

    def observe(self, latency_s: float) -> bool:
        """Learn one call's latency; True when the size changed."""
        if not self.sized or not self.limits.rpm:
            return False
        w = self.LATENCY_WEIGHT
        self.latency_s = latency_s if self.latency_s is None else (
            (1 - w) * self.latency_s + w * latency_s)
        size = min(self.most, advised_calls(self.limits, self.latency_s))
        if size == self.size:
            return False
        self.size = size
        bound = " (max_concurrent)" if size == self.limits.max_concurrent else \
            " (the process's most)" if size == MAX_PROCESS_CALLS else ""
        self.why = (f"3 x {self.limits.rpm / 60:.4g}/s x {self.latency_s * 1000:.0f} ms "
                    f"latency{bound}")
        return True


class CallPool:
    """The calls in flight to one backend from this process, shared by all its running tasks:
    `sizing.size` bounds them (a slot is taken before a grant is booked, so no lease waits
    idle), and as many threads run them, fed by a queue (lighter than an executor's future per
    call). Its threads exist, and have connected to the backend, before the first task."""

    def __init__(self, config: Backend):
        self.sizing = CallSizing(config)
        self._free = threading.Condition()
        self._used = self._threads = 0
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._connect = make_backend(config).connect
        self._grow()

    def _grow(self) -> None:
        while self._threads < self.sizing.size:
            background.thread(f"qrq-call-{self._threads}", self._serve)
            self._threads += 1

    def _serve(self) -> None:
        self._connect()  # a kept-alive connection per thread before its first call
        while True:
            self._jobs.get()()

    def run(self, job: Callable[[], None]) -> None:
        """Run `job` on one of the pool's threads (it must not raise: see `InFlight.track`)."""
        self._jobs.put(job)

    def take(self, wanted: int) -> int:
        """Block for one slot, then take up to `wanted` in all without waiting."""
        with self._free:
            while self._used >= self.sizing.size:
                self._free.wait()
            taken = min(wanted, self.sizing.size - self._used)
            self._used += taken
        return taken

    def give(self, count: int = 1) -> None:
        with self._free:
            self._used -= count
            self._free.notify(count)

    def observe(self, latency_s: float) -> None:
        """One call's latency (the backend's reply time): it may resize the pool."""
        with self._free:
            if self.sizing.observe(latency_s):
                self._grow()
                self._free.notify_all()


class InFlight:
    """The calls one chunk has running on the call pool: wait for all of them, by a deadline,
    and see the first bug one of them hit (rather than let it vanish in a pool thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._idle = threading.Event()
        self._idle.set()
        self.error: BaseException | None = None

    def track(self, call: Callable[[], None]) -> Callable[[], None]:
        with self._lock:
            self._count += 1
            self._idle.clear()

        def job() -> None:
            try:
                call()
            except BaseException as exc:  # re-raised in the chunk's own thread by `wait`
                self.error = self.error or exc
            finally:
                with self._lock:
                    self._count -= 1
                    if not self._count:
                        self._idle.set()

        return job

    def wait(self, timeout: float | None) -> None:
        self._idle.wait(timeout)
        if self.error is not None:
            raise self.error


# a forked pool child builds its own pools and threads
_pools: background.PerProcess[dict[str, CallPool]] = background.PerProcess(dict)


def call_pool(config: Backend) -> CallPool:
    with _pools.locked() as pools:
        if config.name not in pools:
            pools[config.name] = CallPool(config)
        return pools[config.name]


def pool_sizes() -> dict[str, dict]:
    """This process's calls in flight per backend and why (shown by `qrq status`)."""
    with _pools.locked() as pools:
        return {name: {"calls": p.sizing.size, "why": p.sizing.why} for name, p in pools.items()}
