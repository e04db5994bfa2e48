"""Sends a batch's chunks as score_chunk tasks and keeps its lease while any is out."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import redis

from .. import keys
from ..broker import lease
from ..broker.app import QrqCelery
from ..config.model import Route
from ..message import TASK_NAME, chunk_kwargs, summary
from ..planning.capacity import QueuedSamples
from ..planning.routing import Chunk


class Publisher:
    """One batch's sending side: its tasks on the backends' queues, its lease and sentinel,
    and its tasks' results (read only for a chunk that ended with outcomes unrecorded)."""

    def __init__(self, app: QrqCelery, route: Route, batch_id: str, priority: int,
                 deadline: float, job: str):
        self.app, self.route, self.batch_id = app, route, batch_id
        self.priority, self.deadline, self.job = priority, deadline, job
        self._result_keys: dict[str, Any] = {}  # task id -> its result's key, built once
        self.sentinel: str | None = None

    def send(self, owner: object, messages: dict[str, Chunk],
             work: Sequence[dict[str, Any]], votes: bool) -> None:
        """Publish one task per chunk (`messages`: task id -> chunk of positions in `work`),
        all in one batch of one producer; the first send begins the lease, held while `owner`
        (the RewardBatch) lives. A vote stays with its judge: no sibling to fail over to."""
        config = self.app.qrq_config
        # the planner's count of queued samples goes up as they are published (with the
        # lease's round trip at the first send), and down again if publishing fails
        counted, sizes = QueuedSamples.of(self.app), QueuedSamples.sizes(messages.values(), config)
        if not config.embedded and not self.sentinel:
            self.sentinel = keys.batch_sentinel(self.batch_id)
            lease.hold(owner, self.app.store, self.batch_id, config.lease_s,
                       (self.sentinel, self.keep_s()), partial(counted.stage, samples=sizes))
        else:
            counted.add(sizes)
        try:
            self._publish(messages, work, votes)
        except BaseException:
            with contextlib.suppress(redis.RedisError, OSError):
                counted.add({queue: -n for queue, n in sizes.items()})
            raise

    def _publish(self, messages: dict[str, Chunk], work: Sequence[dict[str, Any]],
                 votes: bool) -> None:
        config, expires = self.app.qrq_config, max(1.0, self.deadline - time.time())
        # kombu's publish batch sends every message in one pipelined round trip on Redis
        with self.app.producer_or_acquire() as producer, producer.batch():
            for task_id, chunk in messages.items():
                samples = [work[i] for i in chunk.indices]
                route = [chunk.backend] if votes else list(self.route.backends)
                self.app.send_task(
                    TASK_NAME,
                    kwargs=chunk_kwargs(chunk.backend, samples, route, self.deadline,
                                        self.batch_id, list(chunk.indices), self.job),
                    task_id=task_id,
                    producer=producer,
                    queue=config.backend(chunk.backend).queue,
                    priority=self.priority,
                    expires=expires,
                    **summary(chunk.backend, samples),
                )

    def sentinel_lost(self) -> bool:
        """True if Redis lost the batch's sentinel (its data); it is set again, lease first."""
        if not self.sentinel or self.app.store.exists(self.sentinel):
            return False
        lease.begin(self.app.store, self.batch_id, self.app.qrq_config.lease_s,
                    (self.sentinel, self.keep_s()))
        return True

    def end(self, state: bytes, send: Callable[[Callable[[Any], Any]], None] | None = None
            ) -> None:
        """Tell workers the batch is `done` or `cancelled` (no lease held: nothing to say),
        at once or through `send` (see lease.end)."""
        if self.sentinel:
            lease.end(self.app.store, self.batch_id, state, self.keep_s(), send)

    def keep_s(self) -> float:
        return max(1.0, self.deadline - time.time() + 60)

    def results(self, task_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The stored results among `task_ids` (task id -> Celery's meta), one MGET."""
        if not task_ids:
            return {}
        backend = self.app.backend
        by_key = {self._result_key(t): t for t in task_ids}
        values = backend.mget(list(by_key))
        if not isinstance(values, dict):  # Redis answers a list, the in-memory cache a dict
            values = dict(zip(by_key, values, strict=True))
        return {by_key[k]: backend.decode_result(v) for k, v in values.items() if v}

    def _result_key(self, task_id: str) -> Any:
        key = self._result_keys.get(task_id)
        if key is None:
            key = self._result_keys[task_id] = self.app.backend.get_key_for_task(task_id)
        return key
