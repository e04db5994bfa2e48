"""A Python reward function named by import path, `fn(sample: dict) -> float`, per sample.

One failing sample becomes its own `error` outcome; the rest of the chunk is still scored.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from functools import cache

from ..errors import PermanentError, ScoringError
from .base import BackendClient, Call


@cache
def load_function(path: str) -> Callable[[dict], float]:
    """Import 'package.module:callable' once per process."""
    module_name, _, attr = path.partition(":")
    try:
        target = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise PermanentError(f"cannot import reward function {path!r}: {exc}") from None
    if not callable(target):
        raise PermanentError(f"reward function {path!r} is not callable")
    return target


class FunctionBackend(BackendClient):
    """Scores a whole chunk in one call: the queue overhead is paid per chunk, not per sample."""

    @property
    def batch(self) -> int:
        return max(1, self.config.chunk_size)

    def call(self, samples: list[dict]) -> Call:
        fn = load_function(self.config.function)
        return Call([_score_one(fn, s) for s in samples], details=[None] * len(samples))


def _score_one(fn: Callable[[dict], float], sample: dict) -> float | ScoringError:
    try:
        value = fn(sample)
    except Exception as exc:  # a user function may raise anything; it must not sink the chunk
        return PermanentError(f"reward function raised {type(exc).__name__}: {exc}"[:500])
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        return PermanentError(f"reward function returned {value!r}"[:200] + ", not a finite number")
    return float(value)


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False
