"""One object per app in this process (the client's reader, the fair-share gate): made on
first use, and forgotten in a forked child (the parent's threads are the parent's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from ..background import PerProcess
from ..broker.app import QrqCelery

T = TypeVar("T")


class PerApp(Generic[T]):
    """`get(app)`: this process's `make(app)`, made once per app."""

    def __init__(self, make: Callable[[QrqCelery], T]):
        self._make = make
        self._made: PerProcess[dict[int, tuple[QrqCelery, T]]] = PerProcess(dict)

    def get(self, app: QrqCelery) -> T:
        with self._made.locked() as made:
            found = made.get(id(app))
            if found is None or found[0] is not app:  # an id reused by a newer app
                found = made[id(app)] = (app, self._make(app))
            return found[1]
