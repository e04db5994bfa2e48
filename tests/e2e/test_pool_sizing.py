"""A backend file with only its URL and limits: the worker's call pool sizes itself from the
limits and the latency it sees, is ready before the first task, and says its size and why."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

from support import ROOT, Worker, wait_for, write_config

from qreward_queue.config.model import MAX_PROCESS_CALLS, PROCESS_CALLS, Backend, Limits, Pool
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn
from qreward_queue.worker.call_pool import CallSizing


def backend(limits: Limits, pool: Pool | None = None) -> Backend:
    return Backend("j", "judge", limits=limits, pool=pool or Pool())


def test_with_no_calls_the_size_follows_rate_times_latency():
    # Given a backend at 100 requests/s with no `calls` in its file
    sizing = CallSizing(backend(Limits(rpm=6000), Pool(calls=MAX_PROCESS_CALLS)))
    assert (sizing.size, sizing.why) == (PROCESS_CALLS, "no latency seen yet")
    # When its replies take 100 ms, then 400 ms
    for _ in range(200):
        sizing.observe(0.1)
    assert sizing.size == 30 and sizing.why == "3 x 100/s x 100 ms latency"
    for _ in range(200):
        sizing.observe(0.4)
    # Then the pool holds 3 x rate x latency calls, and follows the latency as it changes
    assert sizing.size == 120


def test_the_size_is_bounded_by_max_concurrent_and_fixed_by_calls():
    # max_concurrent below the usual size bounds it from the start
    assert CallSizing(backend(Limits(max_concurrent=16), Pool(calls=16))).size == 16
    small = CallSizing(backend(Limits(rpm=600, max_concurrent=16), Pool(calls=16)))
    small.observe(0.1)  # 3 x 10/s x 0.1 s = 3: the floor of 8
    assert (small.size, small.why) == (8, "3 x 10/s x 100 ms latency")
    # rpm x latency above max_concurrent stops at it
    capped = CallSizing(backend(Limits(rpm=60000, max_concurrent=200), Pool(calls=200)))
    capped.observe(1.0)
    assert (capped.size, capped.why) == (200, "3 x 1000/s x 1000 ms latency (max_concurrent)")
    # `calls` in the file is kept whatever the latency
    fixed = CallSizing(backend(Limits(rpm=6000), Pool(calls=48, sized=False)))
    assert not fixed.observe(2.0) and (fixed.size, fixed.why) == (
        48, "[pool] calls in the backend file")


def test_a_fresh_worker_is_connected_before_its_first_task_and_says_its_size(
        tmp_path, redis_url, stack):
    judge = stack.enter_context(spawn(MockJudgeSettings(latency_ms=5)))
    # Given a backend file with the URL only, and `concurrency` left from its old meaning
    config = write_config(tmp_path, {"j": {
        "backend": {"kind": "judge", "url": judge.url + "/v1", "model": "mock"},
        "pool": {"concurrency": 32},
    }}, redis_url=redis_url)
    # When its worker starts
    worker = stack.enter_context(Worker(config, "j", "j@sizing"))
    # Then it warns once that the key now counts chunk tasks
    log = worker.log.read_text()
    assert log.count("qrq: warning: ") == 1 and "[pool] concurrency = 32 is the number of " \
        "chunk tasks a worker process runs at once" in log
    # and has opened its kept-alive connections before any task (no request made; each
    # stats() below opens one of its own)
    polls = itertools.count(1)
    wait_for(lambda: judge.stats()["connections_opened"] - next(polls) >= PROCESS_CALLS, 10,
             "the pool's connections")
    assert judge.stats()["requests"] == 0
    # and `qrq status` says how many calls it keeps in flight, and why
    env = {**os.environ, "QRQ_CONFIG": str(config)}
    env.pop("QRQ_REDIS_URL", None)
    out = subprocess.run([sys.executable, "-m", "qreward_queue.cli", "status"], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (f"  j: j@sizing keeps {PROCESS_CALLS} calls in flight (no rpm or max_concurrent: "
            f"{PROCESS_CALLS}, an asyncio client's usual; on the call loop)"
            ) in out.stdout.splitlines()
