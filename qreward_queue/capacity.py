"""What each backend can take now, read from Redis for the pure planner in routing.py:
its rate (the limiter's learned or configured rpm, else its concurrency as a proxy; 0 while
its circuit is open) and the samples already waiting in its queue."""

from __future__ import annotations

from . import keys
from .config import Route
from .routing import chunk_size, water_fill

TYPICAL_BATCH = 4096  # queued tasks are counted as chunks of a batch this big


def queue_depths(store, queue: str) -> dict[int, int]:
    """Messages waiting in `queue` per priority level (kombu keeps one list per level)."""
    with store.pipeline(transaction=False) as pipe:
        for key in keys.queue_lists(queue):
            pipe.llen(key)
        return dict(enumerate(pipe.execute()))


def queue_depth(store, queue: str) -> int:
    """Messages waiting in `queue` over all priority levels."""
    return sum(queue_depths(store, queue).values())


def backend_rate(app, name: str) -> float:
    """Requests per minute backend `name` can take now."""
    if app.breaker(name).is_open():
        return 0.0
    backend = app.backend_config(name)
    limiter = app.limiter(name)
    rpm = limiter.status()["limits"].get("rpm") if limiter else None
    if rpm:
        return rpm["per_minute"]
    return 60.0 * (backend.limits.max_concurrent or backend.pool.calls)


def of(app, names: list[str]) -> tuple[list[float], list[float]]:
    """(rates, queued samples) of the backends `names`, for `routing.water_fill`."""
    rates = [backend_rate(app, b) for b in names]
    queued = []
    for b in names:
        backend = app.backend_config(b)
        tasks = queue_depth(app.store, backend.queue)
        queued.append(tasks * chunk_size(backend, TYPICAL_BATCH))
    return rates, queued


def route_shares(app, route: Route, n: int) -> list[float]:
    """How many of `n` new samples each backend of `route` should get (weight x free capacity)."""
    if len(route.backends) == 1:
        return [1.0]
    rates, queued = of(app, list(route.backends))
    weighted = [w * r for w, r in zip(route.weights, rates, strict=True)]
    return water_fill(n, weighted, queued)
