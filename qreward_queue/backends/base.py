"""The backend interface: a backend splits a chunk into calls and makes one call at a time.

The worker task wraps every call in the global limiter and handles retries, so a backend
only turns samples into a request and a reply into scores (or precise errors).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..config import Backend
from ..errors import ScoringError


@dataclass
class Call:
    """What one backend call produced: a score or an error per sample, and what the server said."""

    scores: list[float | ScoringError]
    tokens: int | None = None
    status_code: int | None = None
    headers: Mapping[str, str] | None = None
    details: list[str | None] = field(default_factory=list)


class BackendClient(ABC):
    """Turns samples into backend calls. Subclasses set how many samples one call takes."""

    def __init__(self, config: Backend):
        self.config = config

    def split(self, samples: list[dict]) -> list[list[int]]:
        """Positions of `samples` grouped into calls; default: `batch` samples per call."""
        size = self.batch
        return [list(range(i, min(i + size, len(samples)))) for i in range(0, len(samples), size)]

    @property
    def batch(self) -> int:
        return 1

    def estimate_tokens(self, samples: list[dict]) -> float:
        """Tokens the call will cost before we know (prompt chars / 4 + output budget)."""
        chars = sum(len(s["prompt"]) + len(s["response"]) for s in samples)
        return chars / 4 + self.config.max_tokens * len(samples)

    @abstractmethod
    def call(self, samples: list[dict]) -> Call:
        """Score `samples` in one call; raise a ScoringError when the whole call failed."""
