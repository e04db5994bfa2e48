"""Several rewards of one sample in one task: a weighted sum (e.g. format + math).

As a function backend:
    [backend]
    kind = "function"
    function = "qreward_queue.rewards.combine:weighted_sum"
    [backend.options]
    parts = [
      { function = "qreward_queue.rewards.format:format_reward", weight = 0.2 },
      { function = "qreward_queue.rewards.math:math_reward", weight = 1.0 },
    ]
A part that fails fails the sample (an `error` naming the part): a sum missing a term would
be a silently wrong reward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..backends.function import builtin_hook
from ..backends.function_runner import load_function


def weighted_sum(sample: dict, parts: Sequence[dict[str, Any]]) -> float:
    """sum(weight x function(sample, **options)) over `parts`."""
    if not parts:
        raise ValueError("weighted_sum: 'parts' is empty")
    total = 0.0
    for i, part in enumerate(parts):
        path = part.get("function")
        if not isinstance(path, str):
            raise ValueError(f"weighted_sum: parts[{i}] has no 'function' import path")
        try:
            value = load_function(path)(sample, **part.get("options", {}))
        except Exception as exc:
            raise ValueError(f"{path} failed: {type(exc).__name__}: {exc}") from exc
        total += float(part.get("weight", 1.0)) * value
    return total


def preflight(parts: Sequence[dict[str, Any]] = (), **_: Any) -> list[str]:
    """The checks of the built-in rewards among `parts` (a code reward's sandbox)."""
    notes: list[str] = []
    for part in parts:
        hook = builtin_hook(part.get("function") or "", "preflight") \
            if isinstance(part, dict) else None
        notes += hook(**part.get("options", {})) if hook else []
    return list(dict.fromkeys(notes))  # one line per sandbox, however many parts use it


weighted_sum.preflight = preflight  # type: ignore[attr-defined]
