"""The result stores Celery keeps chunk outcomes in, as qrq reads them.

Celery loads them by name (`result_backend` names this module) when results are first used.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from celery.backends.cache import CacheBackend
from celery.backends.redis import RedisBackend, SentinelBackend
from kombu.utils.encoding import bytes_to_str

from ..config.redis_conn import FollowingConnection


class _NoRetryState:
    """Result stores that skip the RETRY state, which the client never reads.

    Celery publishes a retry before it stores RETRY; a retry onto a sibling's queue can finish
    in between, and its SUCCESS would then be overwritten by the late RETRY.
    """

    def mark_as_retry(self, *args, **kwargs) -> None:
        return None


# A stored SUCCESS stays (a late duplicate run of the task must not overwrite it, as in
# Celery's own store); else the result is set, with its expiry when one is configured
_STORE = """
local held = redis.call('GET', KEYS[1])
if held then
  local ok, meta = pcall(cjson.decode, held)
  if ok and type(meta) == 'table' and meta.status == 'SUCCESS' then return 0 end
end
if ARGV[2] == '0' then redis.call('SET', KEYS[1], ARGV[1])
else redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2]) end
return 1
"""


class QrqRedisBackend(_NoRetryState, RedisBackend):
    """The client reads results with MGET when a task's end is announced (records.py), so
    no pub/sub subscription per published task and no PUBLISH per stored result."""

    def on_task_call(self, producer, task_id) -> None:
        return None

    def _store_result(self, task_id, result, state, traceback=None, request=None,
                      **kwargs) -> Any:
        """Celery's store (a SUCCESS already there stays) in one round trip: its check (a
        GET) and write (SETEX and PUBLISH in MULTI) were two, for every task."""
        meta = self._get_result_meta(result=result, state=state, traceback=traceback,
                                     request=request)
        meta["task_id"] = bytes_to_str(task_id)
        expires = int(self.expires) if self.expires else 0
        self.ensure(self._stored, (self.get_key_for_task(task_id), self.encode(meta), expires))
        return result

    def _stored(self, key: bytes, value: str, expires: int) -> None:
        self._store_script(keys=[key], args=[value, expires])

    @cached_property
    def _store_script(self) -> Any:
        return self.client.register_script(_STORE)

    def stage_forget(self, task_ids: list[str], pipe: Any) -> None:
        """Drop results the client has read, with the commands on `pipe` (the store's: one
        Redis URL serves both; `result_expires` stays the safety net)."""
        pipe.delete(*(self.get_key_for_task(t) for t in task_ids))


class QrqSentinelBackend(QrqRedisBackend, SentinelBackend):
    """The same result store on the current primary of a Sentinel group (its connections
    follow the sentinels' view, see redis_conn.FollowingConnection)."""

    def _get_pool(self, **params):
        return super()._get_pool(**{**params, "connection_class": FollowingConnection})


class QrqCacheBackend(_NoRetryState, CacheBackend):
    def stage_forget(self, task_ids: list[str], pipe: Any) -> None:
        """Drop results the client has read (in this process: now, `pipe` unused)."""
        for task_id in task_ids:
            self.delete(self.get_key_for_task(task_id))
