"""The backend interface: a backend splits a chunk into calls and makes one call at a time.

The worker task wraps every call in the global limiter and handles retries, so a backend
only turns samples into a request and a reply into scores (or precise errors).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import Backend
from ..errors import PermanentError, ScoringError
from .http import connect

MAX_USAGE_TOKENS = 10**12  # more than any call can cost: a larger count is garbage


@dataclass
class Call:
    """What one backend call produced: a score or an error per sample, and what the server said."""

    scores: list[float | ScoringError]
    tokens: int | None = None
    status_code: int | None = None
    headers: Mapping[str, str] | None = None
    details: list[str | None] = field(default_factory=list)
    usage: tuple[int, int] | None = None  # tokens in and out, as the reply reported them


class BackendClient(ABC):
    """Turns samples into backend calls. Subclasses set how many samples one call takes."""

    endpoint: str | None = None  # where its calls go over HTTP (None: not over HTTP)

    def __init__(self, config: Backend):
        self.config = config

    def connect(self) -> None:
        """Open the calling thread's kept-alive connection ahead of its first call."""
        if self.endpoint is not None:
            connect(self.endpoint, self.config.timeout_s)

    def split(self, samples: list[dict]) -> list[list[int]]:
        """Positions of `samples` grouped into calls; default: `batch` samples per call."""
        size = self.batch
        return [list(range(i, min(i + size, len(samples)))) for i in range(0, len(samples), size)]

    @property
    def batch(self) -> int:
        return 1

    def estimate_usage(self, samples: list[dict]) -> tuple[float, float]:
        """Tokens in and out the call will cost, before we know (chars / 4, output budget)."""
        chars = sum(len(s["prompt"]) + len(s["response"]) for s in samples)
        return chars / 4, float(self.config.max_tokens * len(samples))

    def estimate_tokens(self, samples: list[dict]) -> float:
        return sum(self.estimate_usage(samples))

    @abstractmethod
    def call(self, samples: list[dict]) -> Call:
        """Score `samples` in one call; raise a ScoringError when the whole call failed."""


def usage_tokens(body: Any) -> int | None:
    """`usage.total_tokens` of a reply when it is a plausible count, else None (unknown)."""
    usage = body.get("usage") if isinstance(body, dict) else None
    tokens = usage.get("total_tokens") if isinstance(usage, dict) else None
    return tokens if _plausible(tokens) else None


def usage_split(body: Any) -> tuple[int, int] | None:
    """`usage`'s (prompt_tokens, completion_tokens) when plausible; a reply giving only
    `total_tokens` counts it as input; else None (unknown)."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return None
    counts: list[Any] = [usage.get(k) for k in ("prompt_tokens", "completion_tokens")]
    if all(_plausible(c) for c in counts):
        return counts[0], counts[1]
    total = usage_tokens(body)
    return None if total is None else (total, 0)


def _plausible(tokens: Any) -> bool:
    return isinstance(tokens, int) and not isinstance(tokens, bool) and \
        0 <= tokens <= MAX_USAGE_TOKENS


def checked_score(
    value: Any, score_range: tuple[float, float] | None, what: str, reply: str | None = None
) -> float | PermanentError:
    """`value` as a score, or the error (not raised) that says why it is none.

    Numbers of any size come out of JSON and regexes; one that does not fit a float, is not
    finite or lies outside `score_range` is an error for its own item, quoting `reply`.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return PermanentError(f"{what} is not a number", reply or _preview(value))
    try:
        score = float(value)
    except OverflowError:
        return PermanentError(f"{what} is too large for a float", reply or _preview(value))
    except ValueError:
        return PermanentError(f"{what} is not a number", reply or _preview(value))
    if not math.isfinite(score):
        return PermanentError(f"{what} is not a finite number", reply or _preview(value))
    if score_range is not None and not score_range[0] <= score <= score_range[1]:
        low, high = score_range
        return PermanentError(
            f"{what} is outside score_range [{low:g}, {high:g}]", reply or _preview(value)
        )
    return score


def _preview(value: Any) -> str:
    try:
        text = str(value)
    except ValueError:  # an int past Python's digit limit for str()
        return "<an integer too long to show>"
    return text if len(text) <= 80 else f"{text[:40]}...({len(text)} characters)"
