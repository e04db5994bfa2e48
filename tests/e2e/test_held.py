"""A task's `qrq:held:` key: set when the worker receives the task, said again while the task
runs, kept while it waits out its own retry, and gone once it ended for good, also when it
ended while Redis was away (so its client sees it lost and sends it again once Redis
answers, instead of waiting for the broker's visibility timeout)."""

from __future__ import annotations

import os
import signal

import pytest
import redis
from celery.exceptions import Retry
from support import PrivateRedis, wait_for

from qreward_queue import keys
from qreward_queue.ops.liveness import HeldKeeper


def test_held_keys_from_receipt_outlive_a_retry_but_not_the_end_even_across_an_outage(tmp_path):
    server = PrivateRedis(tmp_path).start()
    try:
        store = redis.Redis.from_url(server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
        keeper = HeldKeeper(every_s=0.2)
        # a task received (waiting for a slot) is held from then on, before it runs
        keeper.received(store, "waiting", "w@a", 60)
        wait_for(lambda: store.get(keys.held("waiting")) == b"w@a", 10, "the receipt said")
        with keeper.holding(store, "waiting", "w@a", 60):
            pass
        wait_for(lambda: not store.exists(keys.held("waiting")), 10, "the ended task forgotten")
        # a task that retries itself keeps its key (its message waits in the worker)
        with pytest.raises(Retry), keeper.holding(store, "retrying", "w@a", 60, keeps=(Retry,)):
            wait_for(lambda: store.get(keys.held("retrying")) == b"w@a", 10, "the key said")
            raise Retry()
        assert store.get(keys.held("retrying")) == b"w@a"
        # a task that ends while Redis is away
        with keeper.holding(store, "ended", "w@a", 60, keeps=(Retry,)):
            wait_for(lambda: store.get(keys.held("ended")) == b"w@a", 10, "the key said")
            os.kill(server.proc.pid, signal.SIGSTOP)
        # is forgotten as soon as Redis answers again
        os.kill(server.proc.pid, signal.SIGCONT)
        wait_for(lambda: not store.exists(keys.held("ended")), 10, "the ended task forgotten")
        assert store.get(keys.held("retrying")) == b"w@a"
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        server.kill()
