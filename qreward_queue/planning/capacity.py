"""What each backend can take now, read from Redis for the pure planner in planning/routing.py:
its rate (the limiter's learned or configured rpm, else its concurrency as a proxy; 0 while
its circuit is open) and the samples already waiting in its queue (`QueuedSamples`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .. import keys
from ..config.model import Config, Route
from .routing import Chunk, water_fill

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


class QueuedSamples:
    """The one owner of the planner's count of samples waiting in each backend's queue
    (`keys.queued_samples`): tasks differ in size, so queue length alone cannot say.

    The client adds a batch's chunks as it publishes them; a worker takes a task's samples
    off as it starts it and adds back what it publishes again (a retry, a failover). Embedded
    mode keeps no count (`counting` False): one process plans and runs everything.
    """

    def __init__(self, store, counting: bool = True):
        self.store, self.counting = store, counting

    @classmethod
    def of(cls, app) -> QueuedSamples:
        """The count `app` plans with (none in embedded mode)."""
        return cls(app.store, not app.qrq_config.embedded)

    def add(self, samples: Mapping[str, int], job: str | None = None,
            level: int | None = None) -> None:
        """`samples[queue]` samples were published to (< 0: taken from) each queue; one
        round trip. A count left behind by lost messages fades after QUEUED_TTL_S. With `job`
        and `level` (a worker's: the task's job and priority level), the job's own count on
        that level, which its fair share is held to (trainer/shares.py), changes too, and
        samples taken off wake the processes' gates."""
        with self.store.pipeline(transaction=False) as pipe:
            if self.stage(pipe, samples, job, level):
                pipe.execute()

    def stage(self, pipe: Any, samples: Mapping[str, int], job: str | None = None,
              level: int | None = None) -> bool:
        """`add` queued on `pipe` (to go with other commands); False: nothing to count."""
        changes = {queue: n for queue, n in samples.items() if n}
        if not (self.counting and changes):
            return False
        for queue, n in changes.items():
            pipe.incrby(keys.queued_samples(queue), n)
            pipe.expire(keys.queued_samples(queue), QUEUED_TTL_S)
            if job is not None and level is not None:
                share = keys.share_keys(queue, level)
                pipe.hincrby(share["queued"], job, n)
                if n < 0:  # room on the level: the gates waiting for it look again
                    pipe.publish(share["drained"], job)
        return True

    @staticmethod
    def sizes(chunks: Iterable[Chunk], config: Config) -> Counter[str]:
        """The samples `chunks` put on each backend's queue."""
        sizes: Counter[str] = Counter()
        for chunk in chunks:
            sizes[config.backend(chunk.backend).queue] += len(chunk.indices)
        return sizes

    def read(self, queue: str) -> int:
        """Samples waiting in `queue` (never below 0: a lost message may leave the count high)."""
        return max(0, int(self.store.get(keys.queued_samples(queue)) or 0))


def backend_rate(app, name: str) -> float:
    """Requests per minute backend `name` can take now."""
    if app.flow.breaker(name).is_open():
        return 0.0
    backend = app.backend_config(name)
    limiter = app.flow.limiter(name)
    rpm = limiter.status()["limits"].get("rpm") if limiter else None
    if rpm:
        return rpm["per_minute"]
    return 60.0 * (backend.limits.max_concurrent or backend.pool.calls)


def of(app, names: list[str]) -> tuple[list[float], list[float]]:
    """(rates, queued samples) of the backends `names`, for `routing.water_fill`."""
    rates, count = [backend_rate(app, b) for b in names], QueuedSamples.of(app)
    return rates, [count.read(app.backend_config(b).queue) for b in names]


def route_shares(app, route: Route, n: int,
                 held: Callable[[str], int] | None = None) -> list[float]:
    """How many of `n` new samples each backend of `route` should get (weight x free capacity);
    `held(backend)`: samples this process holds back for it (fair shares), counted as queued."""
    if len(route.backends) == 1:
        return [1.0]
    rates, queued = of(app, list(route.backends))
    if held is not None:
        queued = [q + held(b) for q, b in zip(queued, route.backends, strict=True)]
    weighted = [w * r for w, r in zip(route.weights, rates, strict=True)]
    return water_fill(n, weighted, queued)
