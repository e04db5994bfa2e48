"""A worker's start: `qrq worker`'s process (`worker_app`) and the trainer's in-process
worker of embedded mode (`EmbeddedWorker`), with what every worker does while it lives: its
heartbeat."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from pathlib import Path

import click
import redis
from celery.signals import (
    after_setup_logger,
    after_setup_task_logger,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)

from .. import background, flushing, keys
from ..backends import make_backend
from ..broker.app import QrqCelery
from ..config.loader import load_backend, load_config
from ..config.model import BUSY_TASKS, Backend
from ..config.redis_conn import check_redis, describe_mode
from ..errors import ConfigError
from ..message import TASK_NAME
from ..ops import liveness
from ..redact import install_log_filter
from .call_loop import call_loop, loop_sizes
from .call_pool import call_pool, pool_sizes
from .tasks import register


def worker_app(backend_file: str, config_path: str | None, concurrency: int | None,
               hostname: str | None, loglevel: str, events: bool) -> tuple[QrqCelery, list[str]]:
    """The app and Celery argv of a worker for the backend in `backend_file`, checked (every
    problem a ConfigError naming file and key) and warmed up: its task registered and its
    connections open before the pool starts."""
    backend = load_backend(backend_file)  # its own file: every problem in it is an error
    broken: dict[str, str] = {}
    config = load_config(config_path, broken)
    for problem in broken.values():
        click.echo(f"qrq: warning: {problem} (left out of its routes here)", err=True)
    if config.embedded:
        raise ConfigError("qrq worker needs Redis: set QRQ_REDIS_URL or [redis] url in qrq.toml")
    for note in make_backend(backend).preflight():  # the kind's own checks, before anything
        click.echo(f"qrq: {note}", err=True)
    check_redis(config)  # at start, one line; once running, an outage is ridden out
    known = config.backends.get(backend.name)
    if known is not None and Path(known.source).resolve() != Path(backend_file).resolve():
        raise ConfigError(
            f"{backend_file}: backend {backend.name!r} is also defined in {known.source}"
        )
    app = QrqCelery(
        dataclasses.replace(config, backends={**config.backends, backend.name: backend})
    )
    if backend.pool.rate_limit:
        app.conf.task_annotations = {TASK_NAME: {"rate_limit": backend.pool.rate_limit}}
    argv = [
        "worker",
        "-Q",
        backend.queue,
        "-P",
        backend.pool.type,
        "-c",
        str(concurrency or backend.pool.concurrency),
        "-n",
        hostname or f"{backend.name}@%h",
        "--loglevel",
        loglevel,
        *(["-E"] if events else []),
    ]
    if backend.pool.type == "prefork":
        argv += ["--max-tasks-per-child", str(backend.pool.max_tasks_per_child)]
        if backend.pool.max_memory_per_child_mb:
            argv += ["--max-memory-per-child", str(backend.pool.max_memory_per_child_mb * 1024)]
    click.echo(
        describe_mode(config) + f"; worker for backend {backend.name!r} on queue {backend.queue}"
    )
    if warning := busy_tasks_warning(backend, concurrency):
        click.echo(f"qrq: warning: {warning}", err=True)
    for logging_ready in (after_setup_logger, after_setup_task_logger):  # no key in a log line
        logging_ready.connect(lambda logger, **_: install_log_filter(logger), weak=False)
    if backend.pool.type == "threads" and make_backend(backend).awaitable:
        call_loop().connect(backend)  # its connections exist before the first task
    elif backend.pool.type == "threads" and not make_backend(backend).runs_locally:
        call_pool(backend)  # its threads and connections exist before the first task
    register(app)  # before the pool forks: its children inherit the task
    return app, argv


def busy_tasks_warning(backend: Backend, override: int | None) -> str | None:
    """One line when the file's `[pool] concurrency` is far above what chunk tasks can use:
    it once meant threads (an earlier README said so); it now counts chunk tasks at once."""
    tasks = backend.pool.concurrency
    if override is not None or backend.pool.type != "threads" or tasks <= BUSY_TASKS:
        return None
    return (f"{backend.source}: [pool] concurrency = {tasks} is the number of chunk tasks a "
            f"worker process runs at once (more than {BUSY_TASKS} only makes chunks smaller), "
            f"not threads: calls in flight are [pool] calls, sized from [limits] when unset")


@worker_shutdown.connect
@worker_process_shutdown.connect
def _flush_buffered(**_) -> None:
    """A stopping worker writes what it still buffers (spend totals, records) first."""
    flushing.flush_all()


@worker_ready.connect
@worker_process_init.connect
def _freeze_boot_objects(sender=None, **_) -> None:
    """What booting made (Celery, kombu, the config, imported modules) lives as long as the
    process: moved out of the collector's sight, a full collection no longer walks it (half
    the collector's time under load). Its garbage goes first; an embedded worker's process
    is the trainer's, whose objects are not ours to freeze."""
    app = getattr(sender, "app", None)
    if isinstance(app, QrqCelery) and app.qrq_config.embedded:
        return
    gc.collect()
    gc.freeze()


@worker_ready.connect
def _start_heartbeat(sender, **_) -> None:
    """Keep `qrq:alive:<node>` fresh while this worker lives: clients resubmit tasks that a
    node without a heartbeat had started, instead of waiting for the visibility timeout."""
    app = sender.app
    if not isinstance(app, QrqCelery) or app.qrq_config.embedded:
        return
    queues = list(app.amqp.queues.consume_from or {})  # also tells clients who serves a queue

    def beat() -> None:
        while True:
            with contextlib.suppress(redis.RedisError):  # Redis restarting: beat again later
                liveness.beat(app.store, sender.hostname, queues, keys.HEARTBEAT_TTL_S,
                              {**pool_sizes(), **loop_sizes()})
            time.sleep(keys.HEARTBEAT_S)

    background.thread("qrq-heartbeat", beat)


class EmbeddedWorker:
    """In-process worker threads consuming every backend's queue (embedded mode only)."""

    def __init__(self, app: QrqCelery, concurrency: int):
        from celery.result import _set_task_join_will_block

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
        self.thread = background.thread("qrq-embedded-worker", self.controller.start)
        _set_task_join_will_block(False)

    def stop(self) -> None:
        self.controller.stop(in_sighandler=False)
        self.thread.join(10)
