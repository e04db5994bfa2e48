"""Keep a worker alive when Redis restarts under it (kombu 5.7.0's Redis transport).

Why: after a lost connection Celery calls `Connection.collect()` and then `close()`. In
`collect()` the channel's first close fails while it drains its pending BRPOP from the dead
socket (a redis ConnectionError, which kombu swallows), so the channel is left half-closed,
and kombu then sets `transport.client = None`. The second close finishes the job: it restores
the unacked messages, needs a new connection pool, and `Channel._connparams` reads
`self.connection.client.hostname`: `AttributeError: 'NoneType' object has no attribute
'hostname'`, not a connection error, so it escapes `ignore_errors` and kills the worker
("Unrecoverable error"). Whether the first close fails depends on timing: in our test, one
run in two with three workers and three Redis restarts.

The fix: remember the connection parameters while the kombu Connection is open and reuse them
once it is gone, so the restore (and late acks of tasks still running) reach Redis as kombu
intends; with nothing remembered, raise a redis ConnectionError, which kombu and Celery
already treat as "broker unavailable, reconnect". The same goes for a channel already closed
(its `connection` is None: a task's retry published through a producer whose channel the
consumer's reconnect closed under it raised AttributeError, and Celery dropped the task):
a ConnectionError has kombu's `ensure` publish again on a new channel.

With a `sentinel://` URL the same close first builds its pool from `connection.client.alt`,
the sentinel list: the pool built while the Connection was open is reused (it asks the
sentinels for the current primary on each new connection). Applied to kombu's Redis channel
classes once per process by `install()`; harmless where the bug does not trigger.

One economy rides along: kombu builds a new redis client object for every publish batch,
ack and delivery bookkeeping (`Channel.conn_or_acquire`), ~0.15 ms of CPU each with redis-py
8 (two to three per task on both sides). A channel now keeps one such client per
connection pool and hands it out again: a redis client is safe to share between threads (each
command takes its own connection from the pool), and a new pool (after a reconnect) gets a
new client.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import redis
from kombu.transport import redis as kombu_redis

_MARK = "_qrq_keeps_connparams"


def install() -> None:
    """Patch `kombu.transport.redis.Channel._connparams` and, for Sentinel URLs,
    `SentinelChannel._sentinel_managed_pool` (which reads `connection.client.alt`, the
    sentinel list, in the same half-closed state) to reuse what they built while the kombu
    Connection was open (idempotent; a kombu without those methods has changed this code
    path, so there is nothing to patch)."""
    _remember(kombu_redis.Channel, "_connparams", dict)
    _remember(getattr(kombu_redis, "SentinelChannel", None), "_sentinel_managed_pool", None)
    if not getattr(kombu_redis.Channel.conn_or_acquire, _MARK, False):
        kombu_redis.Channel.conn_or_acquire = _conn_or_acquire  # type: ignore[method-assign]


@contextlib.contextmanager
def _conn_or_acquire(self: Any, client: Any = None) -> Iterator[Any]:
    """kombu's `conn_or_acquire`, with the client it builds kept for the channel's pool."""
    if client:
        yield client
        return
    kept = self.__dict__.get("_qrq_client")
    if kept is None or kept.connection_pool is not self._pool:
        kept = self.__dict__["_qrq_client"] = self._create_client()
    yield kept


setattr(_conn_or_acquire, _MARK, True)


def _remember(channel, method: str, copy) -> None:
    """Wrap `channel.method(asynchronous)` to keep its last result per `asynchronous` and
    return that (or `copy` of it) once the kombu Connection's client is gone."""
    original = getattr(channel, method, None)
    if original is None or getattr(original, _MARK, False):
        return
    store = f"_qrq_{method.strip('_')}"

    @functools.wraps(original)
    def remembering(self, asynchronous: bool = False):
        remembered = self.__dict__.setdefault(store, {})
        if self.connection is None:  # the channel is closed: kombu revives its user on a new one
            raise redis.ConnectionError("the broker channel was closed")
        if self.connection.client is not None:
            remembered[asynchronous] = value = original(self, asynchronous=asynchronous)
        elif asynchronous in remembered:
            value = remembered[asynchronous]
        else:
            raise redis.ConnectionError("the broker connection was closed before this channel")
        return copy(value) if copy else value

    setattr(remembering, _MARK, True)
    setattr(channel, method, remembering)
