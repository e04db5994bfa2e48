"""Shared fixtures: a real Redis database, emptied before each test."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest
import redis

REDIS_HOST = os.environ.get("QRQ_TEST_REDIS_HOST", "127.0.0.1")
REDIS_PORT = int(os.environ.get("QRQ_TEST_REDIS_PORT", "6379"))
REDIS_DB = int(os.environ.get("QRQ_TEST_REDIS_DB", "15"))

# A shell without job control starts its background commands with SIGINT ignored, and Python
# then installs no KeyboardInterrupt handler (nor do the `qrq` processes the tests start):
# the Ctrl-C tests would wait for an interrupt that never comes. Ctrl-C means Ctrl-C here.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def no_embedded_workers_left():
    """Whatever a test configured, its in-process worker threads stop with it."""
    yield
    from qreward_queue.trainer.runtime import shutdown

    shutdown()


@pytest.fixture
def stack():
    """An ExitStack for the mock judges, workers and servers a test starts."""
    with contextlib.ExitStack() as s:
        yield s


@pytest.fixture
def redis_url() -> str:
    """URL of a real Redis database that is empty when the test starts."""
    client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=REDIS_DB)
    try:
        client.ping()
    except redis.ConnectionError as exc:  # pragma: no cover - environment problem
        pytest.fail(f"Redis is not reachable at {REDIS_HOST}:{REDIS_PORT}: {exc}")
    client.flushdb()
    client.close()
    return f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}"


@pytest.fixture
def redis_client(redis_url: str) -> redis.Redis:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()
