"""Plan a batch over a route: which backend scores which samples, in chunks of what size."""

from __future__ import annotations

from dataclasses import dataclass

from .config import Config, Route


@dataclass(frozen=True)
class Chunk:
    """Samples (by input index) that one task scores on one backend."""

    backend: str
    indices: list[int]


def spread(
    indices: list[int], route: Route, shares: list[float] | None = None
) -> dict[str, list[int]]:
    """Deal `indices` to the route's backends in proportion to `shares` (default: weights).

    Smooth weighted round robin, so every backend's share is interleaved through the batch.
    """
    shares = list(shares or route.weights)
    if not any(share > 0 for share in shares):
        shares = [1.0] * len(shares)
    total = sum(shares)
    current = [0.0] * len(shares)
    dealt: dict[str, list[int]] = {name: [] for name in route.backends}
    for index in indices:
        for k, share in enumerate(shares):
            current[k] += share
        best = max(range(len(shares)), key=current.__getitem__)
        current[best] -= total
        dealt[route.backends[best]].append(index)
    return dealt


def plan(
    config: Config, route: Route, indices: list[int], shares: list[float] | None = None
) -> list[Chunk]:
    """Chunks of each backend's `chunk_size`, interleaved across backends."""
    per_backend = []
    for name, mine in spread(indices, route, shares).items():
        size = config.backend(name).chunk_size
        per_backend.append([Chunk(name, mine[i : i + size]) for i in range(0, len(mine), size)])
    chunks = []
    for row in range(max((len(c) for c in per_backend), default=0)):
        chunks.extend(c[row] for c in per_backend if row < len(c))
    return chunks
