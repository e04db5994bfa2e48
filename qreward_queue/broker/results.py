"""The result stores Celery keeps chunk outcomes in, as qrq reads them.

Celery loads them by name (`result_backend` names this module) when results are first used.
"""

from __future__ import annotations

from celery.backends.cache import CacheBackend
from celery.backends.redis import RedisBackend, SentinelBackend

from ..config.redis_conn import FollowingConnection


class _NoRetryState:
    """Result stores that skip the RETRY state, which the client never reads.

    Celery publishes a retry before it stores RETRY; a retry onto a sibling's queue can finish
    in between, and its SUCCESS would then be overwritten by the late RETRY.
    """

    def mark_as_retry(self, *args, **kwargs) -> None:
        return None


class QrqRedisBackend(_NoRetryState, RedisBackend):
    """RewardBatch polls results with MGET, so no pub/sub subscription per published task."""

    def on_task_call(self, producer, task_id) -> None:
        return None

    def forget_many(self, task_ids: list[str]) -> None:
        """Drop results the client has read (one DEL; `result_expires` stays the safety net)."""
        self.client.delete(*(self.get_key_for_task(t) for t in task_ids))


class QrqSentinelBackend(QrqRedisBackend, SentinelBackend):
    """The same result store on the current primary of a Sentinel group (its connections
    follow the sentinels' view, see redis_conn.FollowingConnection)."""

    def _get_pool(self, **params):
        return super()._get_pool(**{**params, "connection_class": FollowingConnection})


class QrqCacheBackend(_NoRetryState, CacheBackend):
    def forget_many(self, task_ids: list[str]) -> None:
        for task_id in task_ids:
            self.delete(self.get_key_for_task(task_id))
