"""Judge ensembles: several votes per sample (distinct judges, or one judge asked k times),
aggregated into one score that keeps every vote in its detail.

No Redis, no HTTP. A route with `votes = k` (settings.Route) is scored by the client as k
vote-samples per sample (`Ballot.fan_out`): vote j goes to the route's backend j mod its
length, in a chunk of that backend alone (no failover: a vote of one judge never becomes a
second vote of another), each call under its own backend's limits, retries and breaker. A
judge asked more than once gets the vote's number as `seed` and the route's `temperature`,
so its answers are distinct samples. As the votes' outcomes come in, `Ballot.cast` turns
them into `Vote`s and, once a sample has all k, `aggregate(votes, how, quorum)`: the score
with the detail as JSON, or the sample's error. A vote that failed is excluded from the score
and counted; fewer valid votes than the quorum is an `error` outcome (or, when every vote
timed out or was cancelled alike, that status), never a score from too few judges.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..config.model import Route
from ..errors import PermanentError, ScoringError
from ..samples import Outcome, flagged


@dataclass(frozen=True)
class Vote:
    """One judge's answer for one sample: a score, or the error that stands in for it."""

    judge: str
    result: float | ScoringError

    def to_dict(self) -> dict[str, Any]:
        if isinstance(self.result, ScoringError):
            return {"judge": self.judge, "status": self.result.status, "error": str(self.result)}
        return {"judge": self.judge, "score": self.result}


def majority(scores: Sequence[float]) -> float:
    """The most common score; a tie (every score, when all differ) goes to the median of the
    tied scores. So discrete judges (pass/fail, 1-5) get their mode, continuous ones the median,
    and a 2-2 split of pass/fail is 0.5: undecided.

    >>> majority([1, 1, 0]), majority([0.2, 0.9, 0.4]), majority([1, 1, 0, 0])
    (1, 0.4, 0.5)
    """
    counts = Counter(scores)
    top = max(counts.values())
    return statistics.median(score for score, n in counts.items() if n == top)


AGGREGATES: dict[str, Callable[[Sequence[float]], float]] = {
    "mean": statistics.fmean,
    "median": statistics.median,
    "majority": majority,
    "min": min,
}


def aggregate(votes: Sequence[Vote], how: str, quorum: int = 1) -> tuple[float, dict[str, Any]]:
    """The ensemble's score by `how` (one of AGGREGATES) over the votes that scored, and its
    detail: every vote, the spread (max - min of the scores) and how many failed. Fewer than
    `quorum` scores raises PermanentError carrying the same detail as JSON.

    >>> score, detail = aggregate([Vote("a", 0.25), Vote("b", 0.75)], "mean")
    >>> score, detail["spread"], detail["failed"]
    (0.5, 0.5, 0)
    """
    if how not in AGGREGATES:
        raise ValueError(f"unknown aggregate {how!r}: one of {', '.join(AGGREGATES)}")
    if quorum < 1:
        raise ValueError(f"quorum must be at least 1, got {quorum}")
    scores = [v.result for v in votes if not isinstance(v.result, ScoringError)]
    detail = {
        "aggregate": how,
        "votes": [v.to_dict() for v in votes],
        "spread": max(scores) - min(scores) if scores else None,
        "failed": len(votes) - len(scores),
        "quorum": quorum,
    }
    if len(scores) < quorum:
        raise PermanentError(
            f"{len(scores)} of {len(votes)} judges scored, the quorum is {quorum} "
            f"({detail['failed']} failed)",
            json.dumps(detail),
        )
    return AGGREGATES[how](scores), detail


class Ballot:
    """The votes of an ensemble route's samples, as their outcomes come in.

    Vote-samples sit after the batch's own samples: position `offset + k * votes + j` is
    vote j of the k-th sample scored (`originals[k]`)."""

    def __init__(self, route: Route, originals: list[int], offset: int):
        self.route, self.originals, self.offset = route, originals, offset
        self.votes: int = route.votes or 1
        self._cast: dict[int, dict[int, tuple[Vote, Outcome]]] = {}

    def judge(self, j: int) -> str:
        return self.route.backends[j % len(self.route.backends)]

    def fan_out(self, samples: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """The vote-samples, in their positions' order. A judge asked again gets a seed and
        the route's temperature: a distinct sample of its judgement, not a copy."""
        repeated = self.votes > len(self.route.backends)
        return [{**samples[i], "vote": {"index": j, "temperature": self.route.temperature}
                 if repeated else {"index": j}}
                for i in self.originals for j in range(self.votes)]

    def dealt(self) -> dict[str, list[list[int]]]:
        """The vote positions by the backend that casts them (each a unit of its own)."""
        dealt: dict[str, list[list[int]]] = {name: [] for name in self.route.backends}
        for k in range(len(self.originals)):
            for j in range(self.votes):
                dealt[self.judge(j)].append([self.offset + k * self.votes + j])
        return dealt

    def cast(self, position: int, outcome: Outcome) -> tuple[int, Outcome] | None:
        """Count a vote's outcome; the sample's index and outcome once its votes are all in."""
        k, j = divmod(position - self.offset, self.votes)
        name = self.judge(j)
        result: float | ScoringError
        if outcome.scored and outcome.score is not None:
            result = outcome.score
        else:
            result = ScoringError(outcome.error or outcome.status)
            result.status = outcome.status
        ballot = self._cast.setdefault(k, {})
        ballot.setdefault(j, (Vote(name, result), outcome))
        if len(ballot) < self.votes:
            return None
        cast = [ballot[v] for v in range(self.votes)]
        return self.originals[k], self._outcome([v for v, _ in cast], [o for _, o in cast])

    def _outcome(self, votes: list[Vote], outcomes: list[Outcome]) -> Outcome:
        attempts = sum(o.attempts for o in outcomes)
        latency_ms = max(o.latency_ms for o in outcomes)
        # a response flagged by its judges: with on_injection = "min" the lowest vote counts
        flags = sorted({k for o in outcomes for k in flagged(o.detail)})
        how = "min" if flags and self.route.on_injection == "min" else self.route.aggregate
        try:
            score, detail = aggregate(votes, how, self.route.quorum)
        except PermanentError as exc:
            failed = {o.status for o in outcomes if not o.scored}
            if len(failed) == 1 and len(votes) == sum(not o.scored for o in outcomes):
                exc.status = failed.pop()  # every vote timed out, or was cancelled: say so
            return Outcome.failed(exc, self.route.name, attempts, latency_ms)
        if flags:
            detail["injection"] = flags
        return Outcome(score, "ok", self.route.name, attempts, latency_ms,
                       detail=json.dumps(detail))
