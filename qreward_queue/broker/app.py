"""The Celery app: broker, results, JSON-only serialization, one priority queue per backend.

Distributed mode talks to Redis; embedded mode (no Redis URL) uses kombu's in-memory
transport, an in-memory result store and fakeredis for the limiter, so the same tasks and
the same Lua run in one process.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import redis
import redis.asyncio
from celery import Celery
from kombu import Queue
from kombu.transport import redis as kombu_redis
from kombu.utils.imports import symbol_by_name

from .. import keys
from ..config import redis_conn
from ..config.model import Backend, Config
from ..flow.registry import FlowRegistry
from ..priority import Priority
from . import kombu_fix
from .lease import BatchWatch

kombu_fix.install()  # a Redis restart must not kill the worker (see kombu_fix)
# the broker's connections follow the sentinels' view too (see redis_conn.FollowingConnection)
kombu_redis.SentinelChannel.connection_class = redis_conn.FollowingConnection

REDIS_READ_TIMEOUT_S = 3.0  # every Redis command's reply, qrq's and Celery's (blocking reads less)
# A connection idle longer than this is checked before use (redis-py), and kombu drops a
# consumer's BRPOP whose reply is this overdue: a frozen primary is left within seconds, for
# the one the sentinels name now (see redis_conn).
REDIS_HEALTH_CHECK_S = 2
STORE_CONNECTION = {"socket_timeout": REDIS_READ_TIMEOUT_S, "socket_connect_timeout": 5,
                    "health_check_interval": REDIS_HEALTH_CHECK_S}


class QrqCelery(Celery):
    """A Celery app that also carries the qrq configuration and the limiter/cache store."""

    def __init__(self, config: Config):
        super().__init__("qreward_queue")
        self.qrq_config = config
        # the process's limiters, breakers and ledgers, built when a call first needs one
        self.flow = FlowRegistry(config, lambda: self.store,
                                 None if config.embedded else self.store_async)
        self.conf.update(celery_settings(config))
        self.conf.task_queues = [
            Queue(b.queue, routing_key=b.queue) for b in config.backends.values()
        ]

    def _get_backend(self) -> Any:
        """The result backend our settings name by class path (`module:Class+url`). Celery's
        own lookup first reads every installed package's entry points for backend aliases:
        ~30 ms of CPU in each process, paid by the trainer's first step."""
        name, url = self.conf.result_backend.split("+", 1)
        return symbol_by_name(name)(app=self, url=url)

    @cached_property
    def store(self) -> redis.Redis:
        """Redis for the limiter and cache: the real one, or an in-process fakeredis."""
        if self.qrq_config.embedded:
            import fakeredis

            return fakeredis.FakeRedis(server=fakeredis.FakeServer())
        return redis_conn.connect(self.qrq_config, **STORE_CONNECTION)

    def store_async(self) -> redis.asyncio.Redis:
        """The store's asyncio client, for the loop that calls this (the real Redis only)."""
        return redis_conn.connect_async(self.qrq_config, **STORE_CONNECTION)

    @cached_property
    def batch_watch(self) -> BatchWatch:
        """The worker's view of batch leases (cancelled or abandoned batches make no call)."""
        return BatchWatch(self.store)

    def backend_config(self, name: str) -> Backend:
        return self.qrq_config.backend(name)


def celery_settings(config: Config) -> dict:
    """Every Celery setting qrq relies on, with the reason for each in docs/configuration.md."""
    transport = {
        "queue_order_strategy": "priority",
        "priority_steps": list(range(keys.PRIORITY_LEVELS)),
        "sep": ":",
        "global_keyprefix": keys.PREFIX,
        "visibility_timeout": config.visibility_timeout_s,
        "unacked_restore_throttle": 1,
        "socket_timeout": REDIS_READ_TIMEOUT_S,  # kombu's BRPOP waits 1 s in Redis
        "socket_connect_timeout": 5,
        "health_check_interval": REDIS_HEALTH_CHECK_S,
    }
    settings = {
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "task_default_priority": Priority.TRAIN.level,
        "task_queue_max_priority": keys.PRIORITY_LEVELS - 1,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_retry_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "worker_deduplicate_successful_tasks": True,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "broker_connection_retry_on_startup": True,
        "result_expires": config.result_expires_s,
        "result_extended": False,
        # Task events cost a Redis publish each (3 a task, ~20% of a worker's Python time on a
        # fast judge): off until a monitor asks. Flower asks by itself every 5 s (its
        # enable_events option, on by default); `qrq worker --events` forces them on.
        "worker_send_task_events": False,
        "worker_hijack_root_logger": False,
        "worker_soft_shutdown_timeout": 20.0,
        "worker_enable_soft_shutdown_on_idle": True,
        "task_default_queue": "qrq.default",
        # malformed messages (body or headers) are rejected and kept, never kill the worker
        "worker_consumer": "qreward_queue.ops.dead_letter:CheckedConsumer",
    }
    if config.embedded:
        settings.update(
            broker_url="memory://",
            result_backend="qreward_queue.broker.results:QrqCacheBackend+memory://",
            broker_transport_options={"polling_interval": 0.001},
        )
    else:
        settings.update(
            **redis_conn.celery_settings(config, transport, {"global_keyprefix": keys.PREFIX}),
            redis_backend_health_check_interval=REDIS_HEALTH_CHECK_S,
            # a result read never hangs on a dead (or frozen) Redis: the client's deadline
            # holds to within this
            redis_socket_timeout=REDIS_READ_TIMEOUT_S,
            redis_socket_connect_timeout=5,
            redis_retry_on_timeout=True,
        )
    return settings
