"""redis_wait: a wait on Redis ends with the caller's time, and an outage is said once."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import redis

from qreward_queue.broker import redis_wait


def test_within_returns_the_answer_or_stops_waiting_when_the_time_is_spent():
    assert redis_wait.within(1.0, lambda: 42) == 42
    release = threading.Event()
    started = time.monotonic()
    with pytest.raises(redis.TimeoutError, match=r"did not answer within 0\.2 s"):
        redis_wait.within(0.2, release.wait)  # a call that hangs, as on a frozen Redis
    assert time.monotonic() - started < 1.0  # deadline promise: within() ends with the time
    release.set()


def test_a_wait_inside_a_wait_runs_in_place():
    # submit_batch's Redis work runs on a helper thread and publishes from there: the inner
    # wait must not need another helper (the outer one bounds it)
    assert redis_wait.within(1.0, lambda: redis_wait.within(1.0, threading.current_thread)
                             ).name.startswith("qrq-redis-wait")


def test_an_outage_is_said_when_noticed_and_when_over(caplog):
    caplog.set_level(logging.WARNING, logger="qreward_queue")
    outage = redis_wait.Outage("redis://127.0.0.1:1/0")
    now = time.time()
    outage.noticed(redis.ConnectionError("refused"), deadline=now + 30, since=now - 2)
    outage.noticed(redis.ConnectionError("refused"), deadline=now + 30, since=now)  # quiet
    outage.over()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    since = time.strftime("%H:%M:%S", time.localtime(now - 2))
    assert f"redis://127.0.0.1:1/0 unreachable since {since} (2 s: refused)" in said[0]
    assert "retrying until the batch deadline" in said[0]
    assert "answers again after 2" in said[1]
