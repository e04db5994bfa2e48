"""One object per app in this process (the client's reader, the fair-share gate): made on
first use, and forgotten in a forked child (the parent's threads are the parent's)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from ..broker.app import QrqCelery

T = TypeVar("T")


class PerApp(Generic[T]):
    """`get(app)`: this process's `make(app)`, made once per app."""

    def __init__(self, make: Callable[[QrqCelery], T]):
        self._make = make
        self._made: dict[int, tuple[QrqCelery, T]] = {}
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def get(self, app: QrqCelery) -> T:
        with self._lock:
            found = self._made.get(id(app))
            if found is None or found[0] is not app:  # an id reused by a newer app
                found = self._made[id(app)] = (app, self._make(app))
            return found[1]

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._made.clear()
