"""The process's one thread that writes buffered Redis work when it falls due.

Per-call bookkeeping (a chunk's finished outcomes, a backend's spend) is buffered and written
in one round trip a short while later; the write must never block the worker's call loop or
a call's thread. Anything that buffers such work asks for a write at a time (`flush_at`), and
this thread does it then, together with every other write due within TOGETHER_S: a worker
running many chunks pays one round trip per tick, not one per chunk.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import redis

from .background import Daemon, PerProcess

TOGETHER_S = 0.01  # writes due within this long of the first due go in its round trip
Written = Callable[[bool], None]  # told after the round trip: True written, False Redis away


class Flushable(Protocol):
    """Buffers writes to `store`; `stage` takes what is buffered, queues its commands on a
    pipeline of that store and returns what to do once the pipeline ran (a write that failed
    keeps its work for the next), or None when nothing was buffered."""

    store: redis.Redis

    def stage(self, pipe: Any) -> Written | None: ...


def write(targets: Iterable[Flushable]) -> None:
    """Write what `targets` buffer now, on the caller's thread: one round trip per store,
    commands in the order of `targets`."""
    by_store: dict[int, tuple[redis.Redis, list[Flushable]]] = {}
    for target in targets:
        by_store.setdefault(id(target.store), (target.store, []))[1].append(target)
    for store, group in by_store.values():
        with store.pipeline(transaction=False) as pipe:
            ends = [end for target in group if (end := target.stage(pipe)) is not None]
            if not ends:
                continue
            try:
                pipe.execute()
                written = True
            except (redis.RedisError, OSError):
                written = False
        for end in ends:
            end(written)


class _Flusher:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: dict[Flushable, float] = {}
        self._thread = Daemon("qrq-flusher", self._run)

    def flush_at(self, target: Flushable, when: float) -> None:
        with self._cond:
            self._due[target] = min(when, self._due.get(target, when))
            self._thread.ensure()
            self._cond.notify()

    def flush_all(self) -> None:
        with self._cond:
            ready, self._due = list(self._due), {}
        write(ready)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    first = min(self._due.values(), default=now + 60)
                    if first <= now:
                        break
                    self._cond.wait(first - now)
                ready = [t for t, when in self._due.items() if when <= now + TOGETHER_S]
                for target in ready:
                    del self._due[target]
            write(ready)


_flusher = PerProcess(_Flusher)  # a forked child's work is its own, flushed by its own thread


def flush_at(target: Flushable, when: float) -> None:
    """Write what `target` buffers on the flushing thread at `when` (time.monotonic())."""
    _flusher.get().flush_at(target, when)


def flush_all() -> None:
    """Write what this process holds buffered now (a worker that stops must not drop it)."""
    _flusher.get().flush_all()
