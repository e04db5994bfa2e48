"""What each backend can take now, read from Redis for the pure planner in routing.py:
its rate (the limiter's learned or configured rpm, else its concurrency as a proxy; 0 while
its circuit is open) and the samples already waiting in its queue (a counter kept by whoever
publishes a task and by the worker that takes it: tasks differ in size, so queue length alone
cannot say)."""

from __future__ import annotations

from . import keys
from .config import Route
from .routing import water_fill

TYPICAL_BATCH = 4096  # `qrq status` counts queued tasks as chunks of a batch this big
QUEUED_TTL_S = 3600  # a counter left by lost messages fades


def queue_depths(store, queue: str) -> dict[int, int]:
    """Messages waiting in `queue` per priority level (kombu keeps one list per level)."""
    with store.pipeline(transaction=False) as pipe:
        for key in keys.queue_lists(queue):
            pipe.llen(key)
        return dict(enumerate(pipe.execute()))


def queue_depth(store, queue: str) -> int:
    """Messages waiting in `queue` over all priority levels."""
    return sum(queue_depths(store, queue).values())


def count_queued(store, queue: str, n: int) -> None:
    """`n` samples were published to (n < 0: taken from) `queue`; one round trip."""
    if n:
        with store.pipeline(transaction=False) as pipe:
            pipe.incrby(keys.queued_samples(queue), n).expire(keys.queued_samples(queue),
                                                              QUEUED_TTL_S)
            pipe.execute()


def queued(store, queue: str) -> int:
    """Samples waiting in `queue` (never below 0: a lost message may leave the count high)."""
    return max(0, int(store.get(keys.queued_samples(queue)) or 0))


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
    return rates, [queued(app.store, app.backend_config(b).queue) for b in names]


def route_shares(app, route: Route, n: int) -> list[float]:
    """How many of `n` new samples each backend of `route` should get (weight x free capacity)."""
    if len(route.backends) == 1:
        return [1.0]
    rates, queued = of(app, list(route.backends))
    weighted = [w * r for w, r in zip(route.weights, rates, strict=True)]
    return water_fill(n, weighted, queued)
