"""The process-wide app a trainer's calls go through, built once from the configuration."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import redis

from . import redis_conn
from .app import EmbeddedWorker, QrqCelery
from .config import Config, load_config
from .errors import RedisUnreachable

_lock = threading.Lock()
_app: QrqCelery | None = None
_worker: EmbeddedWorker | None = None
MAX_EMBEDDED_THREADS = 256


def configure(config: Config | str | os.PathLike[str] | None = None) -> QrqCelery:
    """Build the app for `config` (a Config, a path, or None for the default lookup).

    In embedded mode this also starts the in-process worker threads.
    """
    global _app, _worker
    if not isinstance(config, Config):
        config = load_config(Path(config) if config else None)
    shutdown()
    with _lock:
        _app = QrqCelery(config)
        if config.embedded and config.backends:
            threads = sum(b.pool.concurrency for b in config.backends.values())
            _worker = EmbeddedWorker(_app, min(threads, MAX_EMBEDDED_THREADS))
        return _app


def shutdown() -> None:
    """Stop the embedded worker threads, if any run (the app stays usable for status)."""
    global _worker
    with _lock:
        if _worker is not None:
            _worker.stop()
            _worker = None


def get_app() -> QrqCelery:
    """The configured app, built from the default configuration on first use."""
    return _app if _app is not None else configure()


def describe_mode(config: Config) -> str:
    """One line saying which mode runs (and where Redis is, without its password)."""
    if config.embedded:
        return (
            "qrq: embedded mode (in-memory broker, in-process workers; "
            "set QRQ_REDIS_URL for distributed mode)"
        )
    return f"qrq: distributed mode (Redis at {redis_conn.describe(config)})"


def redis_problem(config: Config, exc: Exception) -> str:
    """One line saying what went wrong with Redis and what to check."""
    if redis_conn.is_sentinel(config.redis_url):
        problem = redis_conn.sentinel_problem(config)
        if problem:
            return problem
    where, why = redis_conn.describe(config), str(exc).strip() or type(exc).__name__
    if "DB index is out of range" in why:
        return (
            f"Redis at {where} has no such database ({why}): use a database number below the "
            "server's `databases` setting (16 unless redis.conf says otherwise)"
        )
    if isinstance(exc, redis.AuthenticationError) or "NOAUTH" in why or "WRONGPASS" in why:
        return f"Redis at {where} refused the credentials ({why}): check the password in the URL"
    origin = (
        "QRQ_REDIS_URL" if os.environ.get("QRQ_REDIS_URL") else f"[redis] url in {config.source}"
    )
    return (
        f"cannot reach Redis at {where} ({why}): check that redis-server runs there "
        f"and that {origin} names it"
    )


def check_redis(config: Config) -> None:
    """Fail fast, in one line, when distributed mode cannot reach (or select) its database."""
    if config.embedded:
        return
    client = redis_conn.connect(config, socket_connect_timeout=3, socket_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise RedisUnreachable(redis_problem(config, exc)) from None
    finally:
        client.close()
