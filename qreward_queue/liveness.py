"""Which backend queues a live worker consumes, so that a batch published to a queue nobody
serves is said out loud within seconds instead of waiting silently for its deadline.

Each worker's heartbeat keeps `qrq:alive:<node>` fresh (15 s TTL) and adds the node to a set
`qrq:consumers:<queue>` per queue it consumes; a node in that set whose heartbeat key lapsed
is dead and is dropped from the set by whoever reads it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable

import redis

from . import keys

log = logging.getLogger("qreward_queue")
CONSUMERS_TTL_S = 24 * 3600  # the set outlives any pause in heartbeats; refreshed by each beat
CHECK_EVERY_S = 2.0
RECOVERY_GRACE_S = 6.0  # after an outage: a worker's heartbeat period (5 s) and a margin


def beat(store: redis.Redis, node: str, queues: Iterable[str], ttl_s: float) -> None:
    """One heartbeat of worker `node` consuming `queues` (one round trip)."""
    with store.pipeline(transaction=False) as pipe:
        pipe.set(keys.alive(node), 1, ex=int(ttl_s))
        for queue in queues:
            pipe.sadd(keys.consumers(queue), node)
            pipe.expire(keys.consumers(queue), CONSUMERS_TTL_S)
        pipe.execute()


def live_workers(store: redis.Redis, queue: str) -> list[str]:
    """Nodes with a fresh heartbeat that consume `queue` (dead ones are forgotten)."""
    nodes = sorted(n.decode() for n in store.smembers(keys.consumers(queue)))
    if not nodes:
        return []
    alive = store.mget([keys.alive(n) for n in nodes])
    dead = [n for n, a in zip(nodes, alive, strict=True) if not a]
    if dead:
        store.srem(keys.consumers(queue), *dead)
    return [n for n, a in zip(nodes, alive, strict=True) if a]


class NoWorkerWatch:
    """Warns once per backend when a batch waits on a queue that no live worker consumes.

    `check` is cheap to call at every poll: it looks at Redis every CHECK_EVERY_S and warns
    after two looks in a row found nobody (so a worker that is just starting is not reported).
    The batch keeps waiting: a worker may still come.
    """

    def __init__(self, app) -> None:
        self.app = app
        self.warned: set[str] = set()
        self._unserved: set[str] = set()
        self._next = 0.0

    def postpone(self) -> None:
        """Redis was unreachable: its view of the workers is stale (heartbeats lapsed, or a
        restart lost them), so judge only once every worker had time to beat again."""
        self._unserved = set()
        self._next = time.monotonic() + RECOVERY_GRACE_S

    def check(self, backends: Iterable[str]) -> None:
        config = self.app.qrq_config
        if config.embedded or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + CHECK_EVERY_S
        unserved = set()
        with contextlib.suppress(redis.RedisError):  # Redis restarting: look again later
            unserved = {
                b
                for b in set(backends) - self.warned
                if not live_workers(self.app.store, config.backend(b).queue)
            }
        for name in sorted(unserved & self._unserved):
            log.warning("qrq: warning: %s (still waiting, until the batch deadline)",
                        self.cause(name))
            self.warned.add(name)
        self._unserved = unserved - self.warned

    def cause(self, name: str) -> str:
        """What is wrong with backend `name`'s queue, and the command that fixes it."""
        backend = self.app.qrq_config.backend(name)
        return (f"no live worker consumes queue {backend.queue} of backend {name!r}; start one "
                f"with `qrq worker {backend.source}`")
