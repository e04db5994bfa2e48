"""Judge ensembles: several votes per sample (distinct judges, or one judge asked k times),
aggregated into one score that keeps every vote in its detail.

Pure functions. How the call path is meant to use them (a route with `votes = k`): it makes
the k calls (distinct backends, or one asked k times), each under its own backend's limits,
retries and breaker, turns each into a `Vote(backend name, score or the ScoringError it ended
with)`, and calls `aggregate(votes, how, quorum)`: the score with `detail=json.dumps(detail)`,
or the PermanentError it raises as the sample's outcome (Outcome.failed). A vote that failed
is excluded from the score and counted; fewer valid votes than the quorum is an `error`
outcome, never a score from too few judges.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import PermanentError, ScoringError


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
