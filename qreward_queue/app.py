"""The Celery app: broker, results, JSON-only serialization, one priority queue per backend.

Distributed mode talks to Redis; embedded mode (no Redis URL) uses kombu's in-memory
transport, an in-memory result store and fakeredis for the limiter, so the same tasks and
the same Lua run in one process.
"""

from __future__ import annotations

import contextlib
import threading
import time
from functools import cached_property

import redis
import redis.asyncio
from celery import Celery
from celery.signals import task_received, worker_ready
from kombu import Queue
from kombu.transport import redis as kombu_redis

from . import keys, kombu_fix, redis_conn
from .config import Backend, Config
from .flow.breaker import CircuitBreaker
from .flow.limiter import Limiter
from .flow.spend import Ledger
from .lease import BatchWatch
from .ops import liveness
from .ops.liveness import HEARTBEAT_S, HELD_TTL_S
from .priority import Priority

kombu_fix.install()  # a Redis restart must not kill the worker (see kombu_fix)
# the broker's connections follow the sentinels' view too (see redis_conn.FollowingConnection)
kombu_redis.SentinelChannel.connection_class = redis_conn.FollowingConnection

EMBEDDED_FINISH_DELAY_S = 0.01
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
        self._limiters: dict[str, Limiter | None] = {}
        self._breakers: dict[str, CircuitBreaker] = {}
        self._ledgers: dict[str, Ledger] = {}
        self.conf.update(celery_settings(config))
        self.conf.task_queues = [
            Queue(b.queue, routing_key=b.queue) for b in config.backends.values()
        ]

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

    def ledger(self, name: str) -> Ledger:
        """Backend `name`'s spend and budget, as this process's calls add to them."""
        if name not in self._ledgers:
            self._ledgers[name] = Ledger(self.store, self.backend_config(name))
        return self._ledgers[name]

    def limiter(self, name: str) -> Limiter | None:
        """The global limiter of backend `name` (None when its file sets no limits)."""
        if name not in self._limiters:
            b = self.backend_config(name)
            limits = b.limits
            self._limiters[name] = (
                None
                if not (limits.rpm or limits.tpm or limits.max_concurrent)
                else Limiter(
                    self.store,
                    name,
                    rpm=limits.rpm,
                    tpm=limits.tpm,
                    max_concurrent=limits.max_concurrent,
                    burst_s=limits.burst_s,
                    lease_ttl_s=b.timeout_s + 10.0,
                    max_pause_s=limits.max_pause_s,
                    # in-process Lua costs interpreter time: successes are finished together
                    finish_delay_s=EMBEDDED_FINISH_DELAY_S if self.qrq_config.embedded else 0.0,
                    connect_async=None if self.qrq_config.embedded else self.store_async,
                )
            )
        return self._limiters[name]

    def breaker(self, name: str) -> CircuitBreaker:
        """The circuit breaker of backend `name`, shared by every process through the store."""
        if name not in self._breakers:
            retry = self.backend_config(name).retry
            self._breakers[name] = CircuitBreaker(
                self.store, name, retry.breaker_threshold, retry.breaker_cooldown_s
            )
        return self._breakers[name]


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
            result_backend="qreward_queue.results:QrqCacheBackend+memory://",
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


HEARTBEAT_TTL_S = 15


@task_received.connect
def _mark_holder(sender, request, **_) -> None:
    """Record which worker holds each task (running, or waiting out a retry countdown), so a
    client can resubmit the tasks of a worker whose heartbeat lapsed."""
    app = sender.app
    if isinstance(app, QrqCelery) and not app.qrq_config.embedded:
        with contextlib.suppress(redis.RedisError):
            app.store.set(keys.held(request.id), sender.hostname, ex=HELD_TTL_S)


@worker_ready.connect
def _start_heartbeat(sender, **_) -> None:
    """Keep `qrq:alive:<node>` fresh while this worker lives: clients resubmit tasks that a
    node without a heartbeat had started, instead of waiting for the visibility timeout."""
    app = sender.app
    if not isinstance(app, QrqCelery) or app.qrq_config.embedded:
        return
    # worker side only: a trainer's import does without them
    from .worker.call_loop import loop_sizes
    from .worker.call_pool import pool_sizes

    queues = list(app.amqp.queues.consume_from or {})  # also tells clients who serves a queue

    def beat() -> None:
        while True:
            with contextlib.suppress(redis.RedisError):  # Redis restarting: beat again later
                liveness.beat(app.store, sender.hostname, queues, HEARTBEAT_TTL_S,
                              {**pool_sizes(), **loop_sizes()})
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=beat, daemon=True, name="qrq-heartbeat").start()


class EmbeddedWorker:
    """In-process worker threads consuming every backend's queue (embedded mode only)."""

    def __init__(self, app: QrqCelery, concurrency: int):
        from celery.result import _set_task_join_will_block

        from .worker.tasks import register

        register(app)  # the tasks exist where a worker runs them (a client only sends them)
        self.app = app
        app.set_default()  # pool threads look the app up through the process-wide default
        queues = [b.queue for b in app.qrq_config.backends.values()]
        self.controller = app.WorkController(
            app=app,
            pool="threads",
            concurrency=concurrency,
            queues=queues,
            hostname="embedded@qrq",
            loglevel="WARNING",
            without_heartbeat=True,
            without_mingle=True,
            without_gossip=True,
        )
        self.thread = threading.Thread(
            target=self.controller.start, daemon=True, name="qrq-embedded-worker"
        )
        self.thread.start()
        _set_task_join_will_block(False)

    def stop(self) -> None:
        self.controller.stop(in_sighandler=False)
        self.thread.join(10)


def __getattr__(name: str) -> QrqCelery:
    """`celery -A qreward_queue.app flower|inspect ...` finds an app built from the config."""
    if name in ("app", "celery"):
        from .config import load_config

        globals()[name] = built = QrqCelery(load_config())
        return built
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
