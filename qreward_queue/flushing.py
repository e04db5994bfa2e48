"""The process's one thread that writes buffered Redis work when it falls due.

Per-call bookkeeping (a chunk's finished outcomes, a backend's spend) is buffered and written
in one round trip a short while later; the write must never block the worker's call loop or
a call's thread. Anything with a `flush()` method asks for one at a time (`flush_at`), and this
thread calls it then.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

from .background import Daemon, PerProcess


class Flushable(Protocol):
    def flush(self) -> None: ...


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
        """Write everything buffered now, on the caller's thread."""
        with self._cond:
            ready, self._due = list(self._due), {}
        for target in ready:
            target.flush()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    ready = [t for t, when in self._due.items() if when <= now]
                    if ready:
                        break
                    self._cond.wait(min(self._due.values(), default=now + 60) - now)
                for target in ready:
                    del self._due[target]
            for target in ready:
                target.flush()


_flusher = PerProcess(_Flusher)  # a forked child's work is its own, flushed by its own thread


def flush_at(target: Flushable, when: float) -> None:
    """Call `target.flush()` on the flushing thread at `when` (time.monotonic())."""
    _flusher.get().flush_at(target, when)


def flush_all() -> None:
    """Write what this process holds buffered now (a worker that stops must not drop it)."""
    _flusher.get().flush_all()
