"""Per-sample records: what a chunk has finished, kept in Redis as it finishes.

A chunk runs again when its worker is killed, when Redis restarts, or when the client resends
it; without records the new run would buy every sample of the chunk again. Workers write each
finished sample's outcome into the batch's hash (`keys.records`, input index -> outcome) as
calls end, at most FLUSH_EVERY_S after it finished; a task reads the hash before it calls
anything and skips what is there. The same write appends the outcomes to the batch's log
(`keys.record_log`), which the client reads from where it left off: a sample's outcome reaches
the trainer when the sample finishes, not when the last sample of its chunk does.
"""

from __future__ import annotations

import json
import os
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


def read_log(store: redis.Redis, batch_id: str, start: int) -> list[tuple[int, dict]]:
    """The batch's recorded outcomes from position `start` of its log on, in the order they
    were recorded: (input index, outcome dict). A sample run twice may appear twice."""
    entries: list[bytes] = store.lrange(  # type: ignore[assignment]  # bytes: no decoding
        keys.record_log(batch_id), start, -1)
    if not entries:
        return []
    # parsed as one JSON array: a client reads thousands of entries per batch, and a parse
    # per entry costs more than twice as much
    return [tuple(entry) for entry in json.loads(b"[" + b",".join(entries) + b"]")]


class Recorder:
    """Buffers finished outcomes of one task and writes them to the batch's hash and log in one
    round trip, FLUSH_EVERY_S after the previous write at the latest (the process's flusher
    thread does it, so the last samples of a burst need no later record to carry them), and
    at `flush`. A write that fails (Redis away) keeps its records for the next one:
    recording is an economy, never a reason to fail a task."""

    def __init__(self, store: redis.Redis, batch_id: str, deadline: float | None):
        self.store, self.key, self.log = store, keys.records(batch_id), keys.record_log(batch_id)
        self.keep_s = int(max(60.0, (deadline or time.time()) - time.time() + 120))
        self._lock = threading.Lock()
        self._buffer: dict[str, str] = {}
        self._scheduled = False
        self._last = time.monotonic()

    def record(self, index: int, outcome: dict) -> None:
        self.record_all({index: outcome})

    def record_all(self, outcomes: dict[int, dict]) -> None:
        """Record one call's outcomes together: no write carries part of them (a judge's
        group is then never found partly done)."""
        with self._lock:
            self._buffer.update((str(i), json.dumps(o)) for i, o in outcomes.items())
            schedule, self._scheduled = not self._scheduled, True
            due = self._last + FLUSH_EVERY_S
        if schedule:
            _flusher.flush_at(self, due)

    def flush(self) -> None:
        with self._lock:
            batch, self._buffer, self._scheduled = self._buffer, {}, False
            self._last = time.monotonic()
        if not batch:
            return
        try:
            with self.store.pipeline(transaction=False) as pipe:
                # redis-py's mapping type is invariant in its key: dict[str, str] is one
                pipe.hset(self.key, mapping=batch)  # type: ignore[arg-type]
                pipe.rpush(self.log, *(f"[{i}, {outcome}]" for i, outcome in batch.items()))
                pipe.expire(self.key, self.keep_s)
                pipe.expire(self.log, self.keep_s)
                pipe.execute()
        except _REDIS_DOWN:  # the next record schedules the next try (or the task's last flush)
            with self._lock:
                self._buffer = {**batch, **self._buffer}


class _Flusher:
    """The process's one thread that flushes each Recorder when its time comes."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: dict[Recorder, float] = {}
        self._thread: threading.Thread | None = None

    def flush_at(self, recorder: Recorder, when: float) -> None:
        with self._cond:
            self._due[recorder] = min(when, self._due.get(recorder, when))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="qrq-record-flusher",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    ready = [r for r, when in self._due.items() if when <= now]
                    if ready:
                        break
                    self._cond.wait(min(self._due.values(), default=now + 60) - now)
                for recorder in ready:
                    del self._due[recorder]
            for recorder in ready:
                recorder.flush()


_flusher = _Flusher()


def _new_flusher() -> None:
    global _flusher
    _flusher = _Flusher()  # the parent's thread does not exist in a forked child


os.register_at_fork(after_in_child=_new_flusher)
