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

Before any of that, kombu itself must make a message of the item it pops: an item that is not
JSON, not an object, or an envelope kombu cannot read (`"headers": 7`, no `properties`, a
list as `delivery_tag`) raised inside kombu's Redis channel, before Celery sees a message,
and killed the worker ("Unrecoverable error"). `CheckedConsumer.connect` puts a check on
the BRPOP replies of its channel (`checked_pops`, a redis-py response callback, so kombu's
code is untouched): such an item is kept here too, with `envelope_problem`'s reason, and
kombu sees an empty pop and pops the next one.
"""

from __future__ import annotations

import contextlib
import json
import logging
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
from kombu.transport import redis as kombu_redis
from kombu.transport.virtual.base import Base64
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads as kombu_loads

from .. import keys
from ..message import TASK_NAME, ChunkMessage, MalformedMessage

DEAD_LETTER_KEY = keys.DEAD_LETTERS
MAX_DEAD_LETTERS = 1000
MAX_BODY_CHARS = 64 << 10

logger = logging.getLogger(__name__)


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
            problem = body_problem(message.payload) or (  # DecodeError: `on_decode_error`
                kwargs_problem(message.payload[1])       # keeps it
                if message.headers.get("task") == TASK_NAME else None)
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
    """Celery's consumer with every task's strategy behind `checked` and every item its
    channel pops behind `checked_pops` (`worker_consumer`)."""

    Strategies = _Strategies

    def update_strategies(self) -> None:
        super().update_strategies()
        for name, handle in list(self.strategies.items()):
            self.strategies[name] = checked(self.app, handle)

    def connect(self):
        """The broker connection (made again after each loss), its pops checked."""
        connection = super().connect()
        channel = connection.default_channel  # the channel Celery's task consumer pops on
        if isinstance(channel, kombu_redis.Channel):
            channel.client.set_response_callback("BRPOP", checked_pops(self.app))
        return connection

    def on_decode_error(self, message, exc) -> None:
        """Celery logs and drops a body it cannot decode: keep a copy first."""
        keep(self.app, f"undecodable task message: {exc}", **message_fields(message))
        super().on_decode_error(message, exc)


def checked_pops(app) -> Callable:
    """A redis-py response callback for BRPOP: an item kombu cannot make a message of is kept
    as a dead letter and reported as no item (kombu then pops the next one)."""

    def checked_pop(reply, **_):
        if not reply:
            return reply
        key, item = reply
        problem = envelope_problem(item)
        if problem is None:
            return reply
        queue = bytes_to_str(key).removeprefix(keys.PREFIX).rsplit(":", 1)[0]
        logger.error("Dead-lettered an item of queue %s that is not a task message: %s",
                     queue, problem)
        keep(app, f"malformed queue item: {problem}", queue=queue,
             item=item.decode("utf-8", "backslashreplace"))
        return None

    return checked_pop


def envelope_problem(item: bytes) -> str | None:
    """Why an item popped from a queue is not a message envelope kombu's Redis channel can make
    a message of (`kombu/transport/virtual/base.py` `Message`, the Redis `QoS.append`, and
    `_do_restore_message` when it is requeued)."""
    try:
        envelope = kombu_loads(bytes_to_str(item))  # kombu's own decoder, object hook included
    except Exception as exc:  # whatever kombu's decoding raises on it
        return f"not a JSON envelope ({type(exc).__name__}: {_clipped(exc)})"
    if not isinstance(envelope, dict):
        return f"the envelope must be an object, got {_shape(envelope)}"
    properties = envelope.get("properties")
    if not isinstance(properties, dict):
        return f"envelope 'properties' must be an object, got {_quoted(properties)}"
    for where, fields, rules in (("envelope", envelope, ENVELOPE_RULES),
                                 ("properties", properties, PROPERTY_RULES)):
        for name, (ok, kind) in rules.items():
            value = fields.get(name, _ABSENT)
            if not ok(value):
                shown = "nothing" if value is _ABSENT else _quoted(value)
                return f"{where} {name!r} must be {kind}, got {shown}"
    if properties.get("body_encoding") == "base64" and envelope.get("body"):
        try:
            Base64().decode(envelope["body"])
        except ValueError as exc:  # binascii.Error
            return f"envelope 'body' is not base64 ({_clipped(exc)})"
    return None


_ABSENT = object()


def _optional(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is _ABSENT or v is None or ok(v)


def _route(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(value.get(k), str) for k in ("exchange", "routing_key"))


ENVELOPE_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "body": (lambda v: isinstance(v, str), "text"),  # Celery's log of a bad one takes its len()
    "headers": (lambda v: v is _ABSENT or isinstance(v, dict), "an object"),
    "content-type": (_optional(lambda v: isinstance(v, str)), "text or null"),
    "content-encoding": (_optional(lambda v: isinstance(v, str)), "text or null"),
}
PROPERTY_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "delivery_tag": (lambda v: isinstance(v, str), "text"),
    "delivery_info": (_route, "an object with text 'exchange' and 'routing_key'"),
    "body_encoding": (_optional(lambda v: v == "base64" or str(v).lower() == "utf-8"),
                      "'base64', 'utf-8' or null"),
    "priority": (_optional(lambda v: _count(v) and v <= 255), "a whole number 0-255 or null"),
    "correlation_id": (_optional(lambda v: isinstance(v, str)), "text or null"),
    "reply_to": (_optional(lambda v: isinstance(v, str)), "text or null"),
}


def header_problem(headers: Any) -> str | None:
    """Why protocol-2 headers hold something Celery's worker cannot read before the task runs
    (`celery/worker/request.py`, `strategy.py`): each header in HEADER_RULES must be absent or
    of its kind; `id` and `task` must be there."""
    if not isinstance(headers, dict):
        return f"headers must be an object, got {_shape(headers)}"
    missing = [k for k in ("id", "task") if not (isinstance(headers.get(k), str) and headers[k])]
    if missing:
        return f"header(s) {', '.join(missing)} missing, empty or not text"
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


def _clipped(exc: Exception) -> str:
    text = str(exc)
    return text if len(text) <= 80 else text[:77] + "..."


def message_fields(message) -> dict[str, Any]:
    """What a dead letter keeps of a kombu message."""
    body = message.body
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    return {
        "queue": (message.delivery_info or {}).get("routing_key"),
        "headers": message.headers,
        "content_type": message.content_type,
        "body": str(body)[:MAX_BODY_CHARS],
    }


def record(client: redis.Redis, reason: str, **fields: Any) -> None:
    """Push one dead letter (`fields`: where it was, what it held) onto the list, newest first."""
    if isinstance(fields.get("item"), str):
        fields["item"] = fields["item"][:MAX_BODY_CHARS]
    entry = {"at": time.time(), "reason": reason, **fields}
    pipe = client.pipeline()
    pipe.lpush(DEAD_LETTER_KEY, json.dumps(entry, default=repr))
    pipe.ltrim(DEAD_LETTER_KEY, 0, MAX_DEAD_LETTERS - 1)
    pipe.execute()


def read(client: redis.Redis, limit: int = 100) -> list[dict]:
    """The newest `limit` dead letters."""
    return [json.loads(raw) for raw in client.lrange(DEAD_LETTER_KEY, 0, limit - 1)]


def keep(app, reason: str, **fields: Any) -> None:
    """Record a dead letter through the app's store; Redis being down only loses the copy."""
    store = getattr(app, "store", None)
    if store is not None:
        with contextlib.suppress(redis.RedisError):  # the log line remains
            record(store, reason, **fields)


@task_rejected.connect
def _keep_rejected(sender, message, exc, **_) -> None:
    if message is not None:
        keep(sender.app, str(exc) if exc is not None else "unknown message format",
             **message_fields(message))
