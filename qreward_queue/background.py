"""The package's background threads and what a forked child forgets, in one place.

Why: a prefork worker forks its children from a parent that may already run qrq's threads
(the call loop, call pools, lease renewer, flusher, ...) and hold their locks. A forked child
has none of the parent's threads, and a lock some parent thread held at the fork stays held
in the child forever. So each process state that threads serve lives in a `PerProcess`
holder, which the one fork hook below empties in the child (the child builds its own on first
use), and each long-lived thread is a `Daemon`, started on first use in each process.

The event loops qrq runs on its threads (the worker's call loop, the gateway's server) are
uvloop's where it is installed (a core dependency on Linux and macOS): a call loop is most of
a worker's CPU at a few thousand calls a second (each reply a protocol callback, a timer, a
task step), and on uvloop those cost less. `QRQ_EVENT_LOOP=asyncio` keeps asyncio's own loop
(to compare, or to rule the loop out when chasing a bug).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
EVENT_LOOP_ENV = "QRQ_EVENT_LOOP"


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's unless it is missing or `QRQ_EVENT_LOOP=asyncio`."""
    if os.environ.get(EVENT_LOOP_ENV, "").strip().lower() != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def thread(name: str, target: Callable[[], object]) -> threading.Thread:
    """Run `target` on a new daemon thread called `name` (daemon: an exiting interpreter never
    waits for it); the package's one maker of threads."""
    started = threading.Thread(target=target, name=name, daemon=True)
    started.start()
    return started


class _Forgotten:
    """Something whose state a forked child starts afresh: `_forget` runs in the child."""

    def __init__(self) -> None:
        self._forget()
        _in_this_process.add(self)

    def _forget(self) -> None:
        self._lock = threading.Lock()  # the parent's copy may have been held at the fork


class PerProcess(_Forgotten, Generic[T]):
    """This process's `factory()`: made on first use, made again in a forked child."""

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        super().__init__()

    def _forget(self) -> None:
        super()._forget()
        self._value: T | None = None

    def forget(self) -> None:
        """Drop the value here too (the next use makes a new one)."""
        with self._lock:
            self._value = None

    def get(self) -> T:
        """The value, made on first use; once made, read without the lock (calls read it on
        every call)."""
        if (value := self._value) is not None:
            return value
        with self.locked() as value:
            return value

    def peek(self) -> T | None:
        """The value if this process made one yet (None: never made here)."""
        return self._value

    @contextlib.contextmanager
    def locked(self) -> Iterator[T]:
        """The value, held under the holder's lock while the block runs (for a value such as a
        dict that its users read and fill together)."""
        with self._lock:
            if self._value is None:
                self._value = self._factory()
            yield self._value


class Daemon(_Forgotten):
    """`target` on a daemon thread called `name`, started by `ensure`: once in each process,
    and again when it ended (a thread that died of a bug is replaced by the next use)."""

    def __init__(self, name: str, target: Callable[[], object]) -> None:
        self.name, self._target = name, target
        super().__init__()

    def _forget(self) -> None:
        super()._forget()
        self._thread: threading.Thread | None = None

    def ensure(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = thread(self.name, self._target)


_in_this_process: weakref.WeakSet[_Forgotten] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for held in list(_in_this_process):
        held._forget()


os.register_at_fork(after_in_child=_after_fork_in_child)
