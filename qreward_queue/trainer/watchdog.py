"""What no worker can announce: chunks lost with their worker or with Redis's data, and
backends whose queue no live worker consumes.

One cadence (a look every LOOK_EVERY_S) and one grace period: after Redis was away or lost
its data, nothing is judged until every worker's heartbeat has had time to say again what it
holds (a task still running is not bought twice) and which queues it consumes.
"""

from __future__ import annotations

import time
from typing import Any

from .. import keys
from ..broker.app import QrqCelery
from ..config.model import Route
from ..keys import HEARTBEAT_S
from ..ops.liveness import NoWorkerWatch
from ..planning.capacity import queue_depth
from ..planning.routing import Chunk
from .publisher import Publisher

LOOK_EVERY_S = 2.0
RECOVERY_GRACE_S = HEARTBEAT_S + LOOK_EVERY_S + 1.0


class Watchdog:
    """One batch's looks at its outstanding chunks, every LOOK_EVERY_S."""

    def __init__(self, app: QrqCelery, route: Route, publisher: Publisher):
        self.app, self.route, self.publisher = app, route, publisher
        self.next_look = time.monotonic() + LOOK_EVERY_S
        self.no_worker = NoWorkerWatch(app)
        self._quiet_until = 0.0
        self._unheld: set[str] = set()

    def outage(self) -> None:
        """Redis was unreachable: its view of tasks and workers is stale for a while."""
        self._quiet_until = time.monotonic() + RECOVERY_GRACE_S
        self._unheld = set()
        self.no_worker.forget()

    def look(self, pending: dict[str, Chunk]) -> tuple[dict[str, dict[str, Any]], dict[str, Chunk]]:
        """The results stored for `pending` (a task that ended unannounced: its worker could
        not reach Redis then) and the chunks lost: all of them when Redis lost the batch's
        sentinel; those held (running, or waiting out a retry) by a worker whose heartbeat
        lapsed; and those nobody holds while every queue of the route is empty (a message lost
        between a worker's pop and its bookkeeping, or a restart of Redis), seen so at two
        looks in a row."""
        self.next_look = time.monotonic() + LOOK_EVERY_S
        metas = self.publisher.results(list(pending))
        if self.app.qrq_config.embedded:
            return metas, {}
        if self.publisher.sentinel_lost():
            self.outage()
        if time.monotonic() < self._quiet_until:
            return metas, {}
        self.no_worker.check(c.backend for c in pending.values())
        store = self.app.store
        waiting = [t for t in pending if t not in metas]
        holders = dict(zip(waiting, store.mget([keys.held(t) for t in waiting]), strict=True))
        hosts = sorted({h for h in holders.values() if h})
        # redis-py types replies bytes | str; this client does not decode_responses: bytes
        alive = dict(zip(hosts, store.mget([keys.alive(h.decode()) for h in hosts]),  # type: ignore[union-attr]
                         strict=True))
        lost = {t: pending[t] for t, h in holders.items() if h and not alive[h]}
        unheld = {t for t, h in holders.items() if not h}
        if unheld and not any(
            queue_depth(store, self.app.backend_config(b).queue) for b in self.route.backends
        ):
            lost.update({t: pending[t] for t in unheld & self._unheld})
            self._unheld = unheld
        else:
            self._unheld = set()
        return metas, lost
