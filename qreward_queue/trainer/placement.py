"""Where the outcomes of a batch's work go: the one place they are put back in input order.

A chunk's positions point into the batch's work: the batch's own samples, then, on an
ensemble route, its vote-samples (see ensemble.Ballot). `fill` takes an outcome for any
position: a sample's is placed at once (and copied to the identical samples scored with it), a
vote's is counted and places its sample once all its votes are in. A sample keeps the first
outcome placed (what a trainer may already hold is never contradicted).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..config.model import Route
from ..planning.ensemble import Ballot
from ..samples import Outcome

Listener = Callable[[int, Outcome], None]


class Placement:
    """A batch's outcomes in input order, filled position by position of its work."""

    def __init__(self, samples: Sequence[dict[str, Any]], copies: dict[int, list[int]],
                 fallback: float, cache_keys: dict[int, str],
                 judged: Callable[[Outcome], Outcome] = lambda outcome: outcome):
        """`judged`: the route's policy on a sample's outcome before it is placed (e.g.
        `integrity.on_injection`)."""
        self.samples, self._copies, self._fallback = samples, copies, fallback
        self._judged = judged
        self._cache_keys = cache_keys  # a sample's key (cache.unit_keys), where cached
        self.outcomes: list[Outcome | None] = [None] * len(samples)
        self.listeners: list[Listener] = []
        self.work: Sequence[dict[str, Any]] = samples  # what the chunks' positions point at
        self.ballot: Ballot | None = None
        self._filled: set[int] = set()  # positions of the work with an outcome
        self.fresh: dict[str, Outcome] = {}  # new real scores, by cache key, not cached yet

    def vote(self, route: Route, todo: list[int]) -> dict[str, list[list[int]]]:
        """An ensemble route: `todo`'s vote-samples join the work; their positions by the
        backend that casts them."""
        self.ballot = Ballot(route, todo, len(self.samples))
        self.work = [*self.samples, *self.ballot.fan_out(self.samples)]
        return self.ballot.dealt()

    def filled(self, positions: Sequence[int]) -> bool:
        """True once every one of `positions` has had its outcome."""
        return all(p in self._filled for p in positions)

    def fill(self, position: int, outcome: Outcome, cache: bool = False) -> bool:
        """An outcome for `position` of the work; True if it placed a sample's outcome (a new
        real score then waits in `fresh` to be cached, with `cache`)."""
        if position in self._filled:
            return False
        self._filled.add(position)
        i: int | None = position
        if self.ballot is not None and position >= len(self.samples):
            counted = self.ballot.cast(position, outcome)
            i, outcome = counted if counted is not None else (None, outcome)
        if i is None or not self.place(i, self._judged(outcome)):
            return False
        if cache and outcome.status == "ok":
            self.fresh[self._cache_keys[i]] = outcome
        return True

    def place(self, i: int, outcome: Outcome) -> bool:
        """Sample `i`'s outcome, with its id and, on failure, the fallback score; identical
        samples scored once get a copy each. True if this one was placed."""
        if self.outcomes[i] is not None:
            return False
        for j in [i, *self._copies.get(i, ())]:
            placed = self.outcomes[j] = outcome.placed(_id(self.samples[j]), self._fallback)
            for listener in self.listeners:
                listener(j, placed)
        return True

    def take_fresh(self) -> dict[str, Outcome]:
        fresh, self.fresh = self.fresh, {}
        return fresh


def _id(sample: Any) -> Any:
    return sample.get("id") if isinstance(sample, dict) else None
