"""Chaos suite (issue 12): faults a real deployment meets, against real workers and Redis.

Each test reproduces one break found by a fault campaign and fails without its fix. Redis
restarts run on a PRIVATE redis-server (tests/support.py PrivateRedis), never the shared one.
"""

from __future__ import annotations

import time

import pytest
from support import (
    PrivateRedis,
    expected,
    judge_backend,
    start_workers,
    tasks_received,
    wait_for,
    write_config,
)

import qreward_queue
from qreward_queue.mock_judge import MockJudgeSettings, spawn

FALLBACK = -1.0


def samples_for(n: int, tag: str) -> list[dict]:
    return [{"prompt": f"{tag} question {i}", "response": f"answer {i * 3}"} for i in range(n)]


def assert_all_right(app, backend: str, samples: list[dict], outcomes) -> None:
    for i, (sample, outcome) in enumerate(zip(samples, outcomes, strict=True)):
        assert outcome.status == "ok", (i, outcome)
        assert outcome.score == expected(app, backend, sample), (i, outcome)


@pytest.mark.slow
def test_workers_survive_three_redis_restarts_mid_batch(tmp_path, stack):
    # Given a private Redis without persistence, three workers and a judge at ~100 ms a call
    server = PrivateRedis(tmp_path).start()
    stack.callback(server.kill)
    judge = stack.enter_context(spawn(MockJudgeSettings(latency_ms=100, latency_cv=0.2)))
    config_path = write_config(
        tmp_path, {"j": judge_backend(judge.url, concurrency=4)},
        redis_url=server.url, fallback_score=FALLBACK,
    )
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    workers = start_workers(config_path, [("j", f"w{i}@chaos") for i in range(3)])
    for worker in workers:
        stack.callback(worker.kill)
    samples = samples_for(400, "restarts")
    batch = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=150)
    # When Redis is SIGKILLed three times mid-batch, each time back (empty) 3 s later
    for restart in range(3):
        target = batch.completed + 40
        wait_for(lambda t=target: batch.completed >= t, timeout_s=60, what=f"progress {restart}")
        assert batch.completed < len(samples), "the batch finished before the restarts"
        server.kill()
        time.sleep(3)
        server.start()
    outcomes = batch.outcomes(timeout=140)
    # Then no sample is lost and every worker is alive...
    logs = "\n".join(w.log.read_text()[-3000:] for w in workers)
    assert all(w.proc.poll() is None for w in workers), logs
    assert "Unrecoverable error" not in logs, logs
    assert_all_right(app, "j", samples, outcomes)
    # ...and still consuming: a new batch reaches every one of them
    before = [tasks_received(w) for w in workers]
    more = samples_for(60, "after")
    assert_all_right(app, "j", more, qreward_queue.submit_batch(more, route="j", app=app).outcomes())
    after = [tasks_received(w) for w in workers]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
