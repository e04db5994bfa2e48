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


def water_fill(n: int, rates: list[float], queued: list[float]) -> list[float]:
    """Split `n` new samples so every backend drains its queue plus its share at the same time.

    >>> water_fill(60, [10, 20, 30], [0, 0, 0])
    [10.0, 20.0, 30.0]
    >>> water_fill(10, [10, 10], [20, 0])
    [0.0, 10.0]
    """
    active, finish = [i for i, r in enumerate(rates) if r > 0], 0.0
    while active:
        finish = (n + sum(queued[i] for i in active)) / sum(rates[i] for i in active)
        behind = [i for i in active if rates[i] * finish < queued[i]]
        if not behind:
            break
        active = [i for i in active if i not in behind]
    shares = [0.0] * len(rates)
    for i in active:
        shares[i] = rates[i] * finish - queued[i]
    return shares


def backend_rate(app, name: str) -> float:
    """Requests per minute the backend can take now: the limiter's learned or configured rate,
    else its concurrency as a proxy; 0 while its circuit breaker is open."""
    if app.breaker(name).is_open():
        return 0.0
    backend = app.backend_config(name)
    limiter = app.limiter(name)
    rpm = limiter.status()["limits"].get("rpm") if limiter else None
    if rpm:
        return rpm["per_minute"]
    return 60.0 * (backend.limits.max_concurrent or backend.pool.concurrency)


def queued_samples(app, name: str) -> float:
    """Samples waiting in the backend's queue (tasks x chunk size)."""
    from .status import queue_depth

    backend = app.backend_config(name)
    return queue_depth(app.store, backend.queue) * backend.chunk_size


def route_shares(app, route: Route, n: int) -> list[float]:
    """How many of `n` new samples each backend of `route` should get (weight x free capacity)."""
    if len(route.backends) == 1:
        return [1.0]
    rates = [w * backend_rate(app, b) for w, b in zip(route.weights, route.backends, strict=True)]
    return water_fill(n, rates, [queued_samples(app, b) for b in route.backends])


def failover_target(app, candidates: list[str], n: int) -> str:
    """The sibling that would finish `n` more samples soonest (open circuits last)."""
    rates = [backend_rate(app, b) for b in candidates]
    shares = water_fill(n, rates, [queued_samples(app, b) for b in candidates])
    return candidates[max(range(len(candidates)), key=shares.__getitem__)]
