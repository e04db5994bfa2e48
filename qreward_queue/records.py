"""Per-sample records: what a chunk has finished, kept in Redis as it finishes.

A chunk runs again when its worker is killed, when Redis restarts, or when the client resends
it; without records the new run would buy every sample of the chunk again. Workers write each
finished sample's outcome into the batch's hash (`keys.records`, input index -> outcome) as
calls end, at most FLUSH_EVERY_S apart; a task reads the hash before it calls anything and
skips what is there. The client reads it too when it cancels, to keep what was already paid.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence

import redis

from . import keys

FLUSH_EVERY_S = 0.02
_REDIS_DOWN = (redis.RedisError, OSError)


def read(store: redis.Redis, batch_id: str, indices: Sequence[int]) -> dict[int, dict]:
    """The recorded outcomes among `indices` (input index -> outcome dict)."""
    if not indices:
        return {}
    values = store.hmget(keys.records(batch_id), [str(i) for i in indices])
    return {i: json.loads(v) for i, v in zip(indices, values, strict=True) if v is not None}


class Recorder:
    """Buffers finished outcomes of one task and writes them to the batch's hash in one round
    trip every FLUSH_EVERY_S (and at `flush`). A write that fails (Redis away) keeps its
    records for the next one: recording is an economy, never a reason to fail a task."""

    def __init__(self, store: redis.Redis, batch_id: str, deadline: float | None):
        self.store, self.key = store, keys.records(batch_id)
        self.keep_s = int(max(60.0, (deadline or time.time()) - time.time() + 120))
        self._lock = threading.Lock()
        self._buffer: dict[str, str] = {}
        self._last = time.monotonic()

    def record(self, index: int, outcome: dict) -> None:
        with self._lock:
            self._buffer[str(index)] = json.dumps(outcome)
        if time.monotonic() - self._last >= FLUSH_EVERY_S:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            batch, self._buffer = self._buffer, {}
            self._last = time.monotonic()
        if not batch:
            return
        try:
            with self.store.pipeline(transaction=False) as pipe:
                # redis-py's mapping type is invariant in its key: dict[str, str] is one
                pipe.hset(self.key, mapping=batch)  # type: ignore[arg-type]
                pipe.expire(self.key, self.keep_s)
                pipe.execute()
        except _REDIS_DOWN:
            with self._lock:
                self._buffer = {**batch, **self._buffer}
