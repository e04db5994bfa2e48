"""Malformed task messages are rejected once and kept for inspection, never requeued.

Why: Celery unpacks a protocol-2 body as `args, kwargs, embed = body` inside the worker's
main process; a JSON body of the wrong shape (`"str"`, `{"a": 1}`, `[[], {}]`, `null`) raises
ValueError/TypeError there, which is an "Unrecoverable error": the worker exits, the message
goes back to the queue and kills the next worker. Headers do the same (`timelimit` of `5` or
`[1, 2, 3]` is unpacked as `hard, soft`). `CheckedConsumer` turns such a body, or any header
Celery reads before the task runs that is not of its kind (`HEADER_RULES`), into Celery's own
`InvalidTaskError`, which Celery logs once and rejects without requeue; the
`task_rejected` handler then keeps the message (an undecodable body, which Celery logs and
drops on its own, is kept too) in the Redis list `DEAD_LETTER_KEY` (newest
first, at most `MAX_DEAD_LETTERS`), read back with `read()` or `LRANGE qrq:dead-letters 0 -1`.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from datetime import timezone
from typing import Any

import redis
from celery.exceptions import InvalidTaskError
from celery.signals import task_rejected
from celery.utils.time import maybe_iso8601, maybe_make_aware
from celery.worker.consumer import Consumer
from kombu.exceptions import DecodeError

from .. import keys
from ..message import TASK_NAME, ChunkMessage, MalformedMessage

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


def kwargs_problem(kwargs: dict) -> str | None:
    """Why score_chunk's kwargs break its contract (checked before the task takes anything)."""
    try:
        ChunkMessage.from_kwargs(kwargs)
    except MalformedMessage as exc:
        return f"kwargs: {exc}"
    return None


def _shape(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)}"
    return "null" if value is None else type(value).__name__


def checked(app, handle: Callable) -> Callable:
    """A task's strategy (`handle`) behind a shape check of each message."""

    def task_message_handler(message, body, *args, **kw):
        problem = header_problem(message.headers)
        if problem is None and body is None:  # protocol 2: Celery unpacks the payload itself
            try:
                problem = body_problem(message.payload) or (
                    kwargs_problem(message.payload[1])
                    if message.headers.get("task") == TASK_NAME else None)
            except DecodeError as exc:  # Celery logs and drops it; keep a copy first
                keep(app, message, f"undecodable task message: {exc}")
                raise
        if problem is not None:
            raise InvalidTaskError(f"malformed task message: {problem}")
        return handle(message, body, *args, **kw)

    return task_message_handler


def _unknown_task(message, *_) -> None:
    problem = header_problem(message.headers) or (
        f"header 'task' names no task of this worker: {_quoted(message.headers['task'])}")
    raise InvalidTaskError(f"malformed task message: {problem}")


class _Strategies(dict):
    """Task name -> strategy. A name that is not a registered task's (an unhashable one raised
    TypeError in Celery's consumer; an unknown one with a non-text id failed in Celery's
    `mark_as_failure`: both killed the worker) gets a strategy that rejects the message."""

    def __getitem__(self, name: Any) -> Callable:
        if isinstance(name, str) and dict.__contains__(self, name):
            return dict.__getitem__(self, name)
        return _unknown_task


class CheckedConsumer(Consumer):
    """Celery's consumer with every task's strategy behind `checked` (`worker_consumer`)."""

    Strategies = _Strategies

    def update_strategies(self) -> None:
        super().update_strategies()
        for name, handle in list(self.strategies.items()):
            self.strategies[name] = checked(self.app, handle)


def header_problem(headers: Any) -> str | None:
    """Why protocol-2 headers hold something Celery's worker cannot read before the task runs
    (`celery/worker/request.py`, `strategy.py`): each header in HEADER_RULES must be absent or
    of its kind; `id` and `task` must be there."""
    if not isinstance(headers, dict):
        return f"headers must be an object, got {_shape(headers)}"
    missing = [k for k in ("id", "task") if not isinstance(headers.get(k), str)]
    if missing:
        return f"header(s) {', '.join(missing)} missing or not text"
    for name, (ok, kind) in HEADER_RULES.items():
        if name in headers and not ok(headers[name]):
            return f"header {name!r} must be {kind}, got {_quoted(headers[name])}"
    return None


def _text(value: Any) -> bool:
    return value is None or isinstance(value, str)


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _seconds(value: Any) -> bool:
    return value is None or (
        type(value) in (int, float) and math.isfinite(value) and value >= 0
    )


def _time_limits(value: Any) -> bool:
    """Celery unpacks it as `hard, soft = timelimit` in the worker's main process."""
    return value is None or (
        isinstance(value, list) and len(value) == 2 and all(map(_seconds, value))
    )


def _moment(value: Any) -> bool:
    """ISO 8601 text that Celery parses (dateutil) into a time it can schedule."""
    if value is None:
        return True
    if not isinstance(value, str):
        return False
    try:
        return maybe_make_aware(maybe_iso8601(value), timezone.utc).timestamp() is not None
    except (ValueError, TypeError, OverflowError, OSError, AttributeError):
        return False


def _text_list(value: Any) -> bool:
    return value is None or (isinstance(value, list) and all(isinstance(v, str) for v in value))


HEADER_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    **{name: (_text, "text or null") for name in (
        "lang", "shadow", "root_id", "parent_id", "group", "argsrepr", "kwargsrepr", "origin")},
    "timelimit": (_time_limits, "[hard, soft] seconds (each a number >= 0 or null) or null"),
    "eta": (_moment, "an ISO 8601 time or null"),
    "expires": (_moment, "an ISO 8601 time or null"),
    "retries": (_count, "a whole number >= 0"),
    "replaced_task_nesting": (_count, "a whole number >= 0"),
    "group_index": (lambda v: v is None or _count(v), "a whole number >= 0 or null"),
    "ignore_result": (lambda v: v is None or isinstance(v, bool), "true, false or null"),
    "stamped_headers": (_text_list, "a list of text or null"),
    "groups": (_text_list, "a list of text or null"),
    "stamps": (lambda v: v is None or isinstance(v, dict), "an object or null"),
}


def _quoted(value: Any) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


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
    pipe = client.pipeline()
    pipe.lpush(DEAD_LETTER_KEY, json.dumps(entry, default=repr))
    pipe.ltrim(DEAD_LETTER_KEY, 0, MAX_DEAD_LETTERS - 1)
    pipe.execute()


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
