"""Malformed task messages are rejected once and kept for inspection, never requeued.

Why: Celery unpacks a protocol-2 body as `args, kwargs, embed = body` inside the worker's
main process; a JSON body of the wrong shape (`"str"`, `{"a": 1}`, `[[], {}]`, `null`) raises
ValueError/TypeError there, which is an "Unrecoverable error": the worker exits, the message
goes back to the queue and kills the next worker. `checked_strategy` turns such a body into
Celery's own `InvalidTaskError`, which Celery logs once and rejects without requeue; the
`task_rejected` handler then keeps the message (an undecodable body, which Celery logs and
drops on its own, is kept too) in the Redis list `DEAD_LETTER_KEY` (newest
first, at most `MAX_DEAD_LETTERS`), read back with `read()` or `LRANGE qrq:dead-letters 0 -1`.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import redis
from celery.exceptions import InvalidTaskError
from celery.signals import task_rejected
from celery.worker.strategy import default as default_strategy
from kombu.exceptions import DecodeError

from . import keys

DEAD_LETTER_KEY = keys.DEAD_LETTERS
MAX_DEAD_LETTERS = 1000
MAX_BODY_CHARS = 64 << 10


def body_problem(payload: Any) -> str | None:
    """Why a decoded protocol-2 body is not `[args list, kwargs dict, embed dict or null]`."""
    if not isinstance(payload, (list, tuple)) or len(payload) != 3:
        return f"body must be [args, kwargs, embed], got {_shape(payload)}"
    args, kwargs, embed = payload
    if not isinstance(args, (list, tuple)):
        return f"body[0] (args) must be a list, got {_shape(args)}"
    if not isinstance(kwargs, dict):
        return f"body[1] (kwargs) must be an object, got {_shape(kwargs)}"
    if embed is not None and not isinstance(embed, dict):
        return f"body[2] (embed) must be an object or null, got {_shape(embed)}"
    return None


def _shape(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)}"
    return "null" if value is None else type(value).__name__


def checked_strategy(task, app, consumer, **kwargs):
    """Celery's default strategy behind a shape check of each message (`Task.Strategy`)."""
    handle = default_strategy(task, app, consumer, **kwargs)

    def task_message_handler(message, body, *args, **kw):
        problem = header_problem(message.headers)
        if problem is None and body is None:  # protocol 2: Celery unpacks the payload itself
            try:
                problem = body_problem(message.payload)
            except DecodeError as exc:  # Celery logs and drops it; keep a copy first
                keep(app, message, f"undecodable task message: {exc}")
                raise
        if problem is not None:
            raise InvalidTaskError(f"malformed task message: {problem}")
        return handle(message, body, *args, **kw)

    return task_message_handler


def header_problem(headers: Any) -> str | None:
    """Why protocol-2 headers lack what Celery's Request reads unguarded."""
    if not isinstance(headers, dict):
        return f"headers must be an object, got {_shape(headers)}"
    missing = [k for k in ("id", "task") if not isinstance(headers.get(k), str)]
    return f"header(s) {', '.join(missing)} missing or not text" if missing else None


def record(client: redis.Redis, message, reason: str) -> None:
    """Push one rejected message onto the dead-letter list, newest first."""
    body = message.body
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    entry = {
        "at": time.time(),
        "reason": reason,
        "queue": (message.delivery_info or {}).get("routing_key"),
        "headers": message.headers,
        "content_type": message.content_type,
        "body": str(body)[:MAX_BODY_CHARS],
    }
    client.pipeline().lpush(DEAD_LETTER_KEY, json.dumps(entry, default=repr)).ltrim(
        DEAD_LETTER_KEY, 0, MAX_DEAD_LETTERS - 1
    ).execute()


def read(client: redis.Redis, limit: int = 100) -> list[dict]:
    """The newest `limit` dead letters."""
    return [json.loads(raw) for raw in client.lrange(DEAD_LETTER_KEY, 0, limit - 1)]


def keep(app, message, reason: str) -> None:
    """Record `message` through the app's store; Redis being down only loses the copy."""
    store = getattr(app, "store", None)
    if store is not None and message is not None:
        with contextlib.suppress(redis.RedisError):  # Celery's own log line remains
            record(store, message, reason)


@task_rejected.connect
def _keep_rejected(sender, message, exc, **_) -> None:
    keep(sender.app, message, str(exc) if exc is not None else "unknown message format")
