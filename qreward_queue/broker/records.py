"""Per-sample records: what a chunk has finished, kept in Redis as it finishes.

A chunk runs again when its worker is killed, when Redis restarts, or when the client resends
it; without records the new run would buy every sample of the chunk again. Workers write each
finished sample's outcome into the batch's hash (`keys.records`, input index -> outcome) as
calls end, at most FLUSH_EVERY_S after it finished; a task reads the hash before it calls
anything and skips what is there.

The same write announces the outcomes on the submitting process's inbox (`keys.inbox`, a
stream), and a chunk task that ended says so there too (its result is stored by then): the
client's one reader blocks on its inbox (`read_inbox`) instead of polling, so a sample's
outcome reaches the trainer when the sample finishes, not when its chunk does, and a
Redis command is paid per flush and per chunk, not per sample.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import redis
from celery import signals
from celery.states import READY_STATES

from .. import flushing, keys
from ..background import PerProcess
from ..message import TASK_NAME

FLUSH_EVERY_S = 0.02
_REDIS_DOWN = (redis.RedisError, OSError)


def read(store: redis.Redis, batch_id: str, indices: Sequence[int]) -> dict[int, dict]:
    """The recorded outcomes among `indices` (input index -> outcome dict)."""
    if not indices:
        return {}
    return parsed(indices, store.hmget(keys.records(batch_id), [str(i) for i in indices]))


def stage_read(pipe: Any, batch_id: str, indices: Sequence[int]) -> None:
    """`read` as one command queued on `pipe` (`parsed` reads its reply); `indices` not
    empty."""
    pipe.hmget(keys.records(batch_id), [str(i) for i in indices])


def parsed(indices: Sequence[int], values: Sequence[Any]) -> dict[int, dict]:
    """What `read` returns, from the HMGET's reply."""
    return {i: json.loads(v) for i, v in zip(indices, values, strict=True) if v is not None}


class Finished(NamedTuple):
    """One inbox entry: outcomes recorded for a batch, or a chunk task of it that ended."""

    batch_id: str
    records: list[tuple[int, dict]]  # (input index, outcome dict); a sample run twice: twice
    task_id: str | None  # a chunk task that ended (its result is stored)


def read_inbox(store: redis.Redis, inbox: str, after: bytes, block_ms: int,
               in_process: bool = False, writes: Sequence[Callable[[Any], Any]] = ()
               ) -> tuple[bytes, list[Finished]]:
    """The entries of `inbox` after id `after`, waiting up to `block_ms` for the first (0: not
    at all); and the id to read after next. What was read before is trimmed in the same round
    trip (only this process reads its inbox), after `writes` (each queues commands on the
    pipeline: writes nobody waits for). Redis is waited on in Redis (XREAD BLOCK); an
    `in_process` store (embedded mode's, whose workers are threads of this process) on this
    process's announcements, since its blocking read would wake at every write it gets."""
    news = _news.get()
    seen = news.count
    after, finished = _read(store, inbox, after, None if in_process else block_ms or None,
                            writes)
    if finished or not in_process or not block_ms or not news.wait_past(seen, block_ms):
        return after, finished
    return _read(store, inbox, after, None)


def _read(store: redis.Redis, inbox: str, after: bytes, block_ms: int | None,
          writes: Sequence[Callable[[Any], Any]] = ()) -> tuple[bytes, list[Finished]]:
    with store.pipeline(transaction=False) as pipe:
        for write in writes:
            write(pipe)
        pipe.xtrim(inbox, minid=after, approximate=False)
        pipe.xread({inbox: after}, count=None, block=block_ms)
        reply = pipe.execute()[-1]
    finished: list[Finished] = []
    for _, entries in reply or ():
        for entry_id, fields in entries:
            batch_id, task_id = fields[b"b"].decode(), fields.get(b"end")
            logged = fields.get(b"r")
            finished.append(Finished(batch_id, [tuple(e) for e in json.loads(logged)]
                                     if logged else [], task_id and task_id.decode()))
            after = entry_id
    return after, finished


class _News:
    """Announcements made by this process (counted), for a reader of an in-process store."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.count = 0

    def told(self) -> None:
        with self._cond:
            self.count += 1
            self._cond.notify_all()

    def wait_past(self, seen: int, ms: int) -> bool:
        """Wait up to `ms` for an announcement after the `seen`-th; True if one came."""
        with self._cond:
            return self._cond.wait_for(lambda: self.count != seen, ms / 1000)


_news = PerProcess(_News)  # the parent's waiters do not exist in a forked child


def _announce(pipe: Any, batch_id: str, keep_s: int, **fields: str) -> None:
    inbox = keys.inbox(batch_id)
    pipe.xadd(inbox, {"b": batch_id, **fields})
    pipe.expire(inbox, keep_s)


@signals.task_postrun.connect
def _announce_end(task: Any = None, task_id: str | None = None, kwargs: dict | None = None,
                  state: str | None = None, **_: Any) -> None:
    """A chunk task ended (not a retry): its client reads its result now. Celery stores the
    result before this signal, so the client never finds it missing."""
    batch = (kwargs or {}).get("batch")
    if not batch or not task_id or state not in READY_STATES or task.name != TASK_NAME:
        return
    try:
        with task.app.store.pipeline(transaction=False) as pipe:
            _announce(pipe, batch, _keep_s(kwargs.get("deadline")), end=task_id)  # type: ignore[union-attr]
            pipe.execute()
        _news.get().told()
    except _REDIS_DOWN:  # the client's watchdog reads the result at its next look
        pass


def _keep_s(deadline: float | None) -> int:
    return int(max(60.0, (deadline or time.time()) - time.time() + 120))


class Recorder:
    """Buffers finished outcomes of one task and writes them to the batch's hash and its
    client's inbox in one round trip, FLUSH_EVERY_S after the previous write at the latest
    (the process's flusher thread does it, with the other writes then due, so the last
    samples of a burst need no later record to carry them), and at `flush`. A write that
    fails (Redis away) keeps its records for the next one: recording is an economy, never a
    reason to fail a task.

    `paid(pipe)` queues the spend of the calls behind the outcomes on the same round trip,
    before them (the batch's share of the backend's ledger, `Ledger.stage_batch`), so
    whoever reads an outcome finds its call's spend already counted (a batch's summary right
    after its last outcome is exact)."""

    def __init__(self, store: redis.Redis, batch_id: str, deadline: float | None,
                 paid: Callable[[Any], flushing.Written | None] = lambda pipe: None):
        self.store, self.batch_id, self.key = store, batch_id, keys.records(batch_id)
        self.paid = paid
        self.keep_s = _keep_s(deadline)
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
            flushing.flush_at(self, due)

    def flush(self) -> None:
        """Write what is buffered now."""
        flushing.write([self])

    def stage(self, pipe: Any) -> flushing.Written | None:
        """Queue the buffered records on `pipe` (see `flushing.Flushable`)."""
        with self._lock:
            batch, self._buffer, self._scheduled = self._buffer, {}, False
            self._last = time.monotonic()
        if not batch:
            return None
        paid = self.paid(pipe)  # a call's spend is added before its outcomes are recorded
        pipe.hset(self.key, mapping=batch)
        pipe.expire(self.key, self.keep_s)
        logged = ",".join(f"[{i},{outcome}]" for i, outcome in batch.items())
        _announce(pipe, self.batch_id, self.keep_s, r=f"[{logged}]")

        def written(ok: bool) -> None:
            if paid is not None:
                paid(ok)
            if ok:
                _news.get().told()
            else:  # the next record schedules the next try (or the task's last flush)
                with self._lock:
                    self._buffer = {**batch, **self._buffer}
        return written
