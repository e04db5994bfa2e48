"""Batch leases: no judge call is made for a batch nobody waits for.

The client holds `qrq:lease:<batch>` while the batch is outstanding: `live` with a short TTL,
renewed by one thread per process (`hold`), then set to `cancelled` (cancel(), an interrupted
wait) or `done` (every outcome in). Workers ask `BatchWatch.stop_reason` before each task and
each call: a lease saying `cancelled`/`done`, or one that lapsed while the batch's sentinel is
still there (the client died: kill -9, OOM, a lost node), stops the batch's calls. A lapsed
lease must be seen lapsed for keys.LEASE_CONFIRM_S before it counts, so a lease that a Redis
outage let expire (and that the client sets again at once when Redis is back) stops nothing;
the key's TTL is the configured lease minus that (keys.lease_ttl_ms), so workers stop within
`lease_s` of the last renewal.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import redis

from .. import keys
from ..background import Daemon, PerProcess

CHECK_EVERY_S = 0.25  # a worker looks at a batch's lease at most this often
RETRY_S = 0.5  # a renewal that failed (Redis away) is tried again this soon
LIVE, CANCELLED, DONE = b"live", b"cancelled", b"done"
_REDIS_DOWN = (redis.RedisError, OSError)


# Renew leases still `live` (or lapsed): one that says `cancelled` or `done` stays so, even
# when the renewal raced the cancel.
_RENEW = """
for i, key in ipairs(KEYS) do
  local state = redis.call('GET', key)
  if state ~= 'cancelled' and state ~= 'done' then
    redis.call('SET', key, 'live', 'PX', ARGV[i])
  end
end
return 0
"""


class _Renewer:
    """The process's lease keeper: one thread renews every held lease, one Lua call a store."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, tuple[redis.Redis, int]] = {}
        self._scripts: dict[int, Any] = {}
        self._thread = Daemon("qrq-lease", self._run)

    def hold(self, store: redis.Redis, batch_id: str, lease_s: float) -> None:
        with self._lock:
            self._held[batch_id] = (store, keys.lease_ttl_ms(lease_s))
            self._scripts.setdefault(id(store), store.register_script(_RENEW))
            self._thread.ensure()

    def drop(self, batch_id: str) -> None:
        with self._lock:
            self._held.pop(batch_id, None)

    def _run(self) -> None:
        while True:
            with self._lock:
                held = list(self._held.items())
                scripts = dict(self._scripts)
            wait = min((ttl / 3000 for _, (_, ttl) in held), default=1.0)
            by_store: dict[int, list[tuple[str, int]]] = {}
            for batch_id, (store, ttl) in held:
                by_store.setdefault(id(store), []).append((batch_id, ttl))
            for store_id, group in by_store.items():
                try:
                    scripts[store_id](keys=[keys.lease(b) for b, _ in group],
                                      args=[ttl for _, ttl in group])
                except _REDIS_DOWN:  # Redis away: try again soon, so a restart costs nothing
                    wait = RETRY_S
            time.sleep(min(wait, 5.0))


_renewer = PerProcess(_Renewer)  # a forked child: the parent's batches are the parent's


def begin(store: redis.Redis, batch_id: str, lease_s: float,
          sentinel: tuple[str, float] | None = None,
          also: Callable[[Any], Any] | None = None) -> None:
    """Set `batch_id`'s lease `live` (nx: a cancel stays) and, with `sentinel` (its key and
    seconds to keep it), the batch's sentinel after it, in one round trip (with the writes
    `also` queues on its pipeline). Redis losing its data takes the sentinel with it; the
    lease comes first, so that no worker sees the sentinel without a live lease."""
    with store.pipeline(transaction=False) as pipe:
        pipe.set(keys.lease(batch_id), LIVE, px=keys.lease_ttl_ms(lease_s), nx=True)
        if sentinel is not None:
            pipe.set(sentinel[0], 1, px=int(sentinel[1] * 1000))
        if also is not None:
            also(pipe)
        pipe.execute()


def hold(owner: object, store: redis.Redis, batch_id: str, lease_s: float,
         sentinel: tuple[str, float] | None = None,
         also: Callable[[Any], Any] | None = None) -> None:
    """`begin` the lease, then keep it live while `owner` (the RewardBatch) exists and until
    `end`."""
    begin(store, batch_id, lease_s, sentinel, also)
    renewer = _renewer.get()
    renewer.hold(store, batch_id, lease_s)
    weakref.finalize(owner, renewer.drop, batch_id)  # a batch nobody holds: let it lapse


def release(batch_id: str) -> None:
    """Stop renewing `batch_id`'s lease (it lapses; workers past the deadline stop anyway)."""
    _renewer.get().drop(batch_id)


def end(store: redis.Redis, batch_id: str, state: bytes, keep_s: float,
        send: Callable[[Callable[[Any], Any]], None] | None = None) -> None:
    """Stop renewing and tell workers why (`cancelled` or `done`), for `keep_s`: at once, or
    through `send`, which runs the write (given a pipeline of `store`) when it can."""
    _renewer.get().drop(batch_id)
    write = partial(_say, keys.lease(batch_id), state, int(max(keep_s, 1.0) * 1000))
    if send is None:
        write(store)
    else:
        send(write)


def _say(key: str, state: bytes, keep_ms: int, redis_or_pipe: Any) -> None:
    redis_or_pipe.set(key, state, px=keep_ms)


class BatchWatch:
    """A worker's view of batch leases, cached CHECK_EVERY_S per batch (one MGET a look)."""

    def __init__(self, store: redis.Redis) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, str | None, float | None]] = {}

    def stop_reason(self, batch_id: str | None) -> str | None:
        """Why calls for `batch_id` must stop (None: go on, also when Redis cannot say)."""
        if batch_id is None:
            return None
        look, reason = self._due(batch_id)
        if look is None:
            return reason
        try:
            reply = self.store.mget(keys.lease(batch_id), keys.batch_sentinel(batch_id))
        except _REDIS_DOWN:
            reply = None
        return look(reply)

    def stage(self, pipe: Any, batch_id: str) -> Callable[[list | None], str | None] | None:
        """Queue a look at `batch_id`'s lease on `pipe` (one command), unless the last look
        is recent enough (None); what is returned takes the command's reply (None: Redis could
        not say) and gives the stop reason."""
        look, _ = self._due(batch_id)
        if look is not None:
            pipe.mget(keys.lease(batch_id), keys.batch_sentinel(batch_id))
        return look

    def _due(self, batch_id: str) -> tuple[Callable[[list | None], str | None] | None, str | None]:
        """(how to judge a new look, None when the last is recent enough; the last answer)."""
        now = time.monotonic()
        with self._lock:
            checked, reason, lapsed_since = self._seen.get(batch_id, (0.0, None, None))
            if now - checked < CHECK_EVERY_S:
                return None, reason
            self._seen[batch_id] = (now, reason, lapsed_since)  # the other calls keep it
        return partial(self._judge, batch_id, now, reason, lapsed_since), reason

    def _judge(self, batch_id: str, now: float, reason: str | None, lapsed_since: float | None,
               reply: list | None) -> str | None:
        """The stop reason a look's `reply` (lease, sentinel) gives, remembered."""
        if reply is None:  # Redis away: the last answer stands
            return reason
        lease, sentinel = reply
        if lease in (CANCELLED, DONE):
            reason, lapsed_since = (
                "the batch was cancelled by its caller" if lease == CANCELLED
                else "the batch already has every outcome"), None
        elif lease is None and sentinel is not None:  # lapsed, while Redis kept its data
            lapsed_since = lapsed_since or now
            if now - lapsed_since >= keys.LEASE_CONFIRM_S:
                reason = "the caller's lease lapsed (its client stopped renewing it)"
        else:
            reason, lapsed_since = None, None
        with self._lock:
            if len(self._seen) > 10_000:
                self._seen.clear()
            self._seen[batch_id] = (now, reason, lapsed_since)
        return reason

