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
already treat as "broker unavailable, reconnect". Applied to kombu's Redis Channel class once
per process by `install()`; harmless where the bug does not trigger.
"""

from __future__ import annotations

import functools

import redis
from kombu.transport import redis as kombu_redis

_MARK = "_qrq_keeps_connparams"


def install() -> None:
    """Patch `kombu.transport.redis.Channel._connparams` (idempotent; a kombu without that
    method has changed this code path, so there is nothing to patch)."""
    channel = kombu_redis.Channel
    original = getattr(channel, "_connparams", None)
    if original is None or getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def _connparams(self, asynchronous: bool = False) -> dict:
        remembered = self.__dict__.setdefault("_qrq_connparams", {})
        if self.connection.client is not None:
            remembered[asynchronous] = params = original(self, asynchronous=asynchronous)
            return dict(params)
        if asynchronous in remembered:
            return dict(remembered[asynchronous])
        raise redis.ConnectionError("the broker connection was closed before this channel")

    setattr(_connparams, _MARK, True)
    channel._connparams = _connparams
