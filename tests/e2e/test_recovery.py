"""Never lose a reward (DESIGN.md section 6): a Redis restart and a vanished worker.

Real Redis, real `qrq worker` subprocesses, mock judges over HTTP. The Redis restart runs
on a PRIVATE redis-server started here (no persistence, so a restart loses every queue,
result and key); the shared test Redis is never touched by it.
"""

from __future__ import annotations

import time

from support import (
    PrivateRedis,
    expected,
    free_port,
    judge_backend,
    start_workers,
    tasks_received,
    wait_for,
    write_config,
)

import qreward_queue
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn

FALLBACK = -1.0


def samples_for(n: int, tag: str) -> list[dict]:
    return [{"prompt": f"{tag} question {i}", "response": f"answer {i * 3}"} for i in range(n)]


def test_redis_restart_loses_no_reward(tmp_path, stack):
    # Given a private Redis without persistence, one worker and a judge at ~100 ms a call
    server = PrivateRedis(tmp_path).start()
    stack.callback(server.kill)
    judge = stack.enter_context(spawn(MockJudgeSettings(latency_ms=100, latency_cv=0.2)))
    # small chunks, two at a time: most of the batch is still queued when Redis goes
    backend = judge_backend(judge.url, concurrency=2, chunk_size=10)
    config_path = write_config(
        tmp_path, {"j": backend}, redis_url=server.url, fallback_score=FALLBACK
    )
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    (worker,) = start_workers(config_path, [("j", None)])
    stack.callback(worker.kill)
    samples = samples_for(300, "restart")
    deadline_s = 90
    # When Redis is SIGKILLed once about a third is done, and back (empty) 2 s later
    batch = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=deadline_s)
    wait_for(lambda: batch.completed >= 100, timeout_s=30, what="a third of the batch")
    done_before = batch.completed
    assert done_before < 250, "the batch finished before Redis could be killed"
    server.kill()
    time.sleep(2)
    server.start()
    outcomes = batch.outcomes(timeout=deadline_s - 5)
    # Then every sample has an outcome, every one right (none a timeout: all before the deadline)
    assert len(outcomes) == 300 and all(o is not None for o in outcomes)
    statuses = {o.status for o in outcomes}
    assert statuses <= {"ok", "timeout"}, statuses
    for i, (sample, outcome) in enumerate(zip(samples, outcomes, strict=True)):
        if outcome.status == "ok":
            assert outcome.score == expected(app, "j", sample), (i, outcome)
        else:  # only an explicit timeout may stand in for a score
            assert outcome.score == FALLBACK and outcome.error, (i, outcome)
    assert statuses == {"ok"}, ([o for o in outcomes if o.status != "ok"][:3],
                                batch.resubmitted, worker.log.read_text()[-4000:])
    # because the client noticed the queued work Redis lost and sent it again
    assert batch.resubmitted > 0
    assert judge.stats()["accepted"] >= 300 - done_before
    assert worker.proc.poll() is None, worker.log.read_text()[-3000:]


def test_vanished_worker_work_is_resubmitted_long_before_visibility_timeout(
    tmp_path, redis_url, stack
):
    # Given two workers on one backend, with a visibility timeout (600 s) far beyond the test,
    # so kombu redelivering the dead worker's unacked messages cannot be what saves the batch
    judge = stack.enter_context(spawn(MockJudgeSettings(latency_ms=300, latency_cv=0.2)))
    config_path = write_config(
        tmp_path,
        {"j": judge_backend(judge.url, concurrency=4, calls=8, chunk_size=4)},
        redis_url=redis_url,
        fallback_score=FALLBACK,
        visibility_timeout_s=600,
    )
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    doomed, survivor = start_workers(
        config_path, [("j", "doomed@recovery"), ("j", "survivor@recovery")]
    )
    stack.callback(doomed.kill)
    stack.callback(survivor.kill)
    samples = samples_for(100, "vanish")
    batch = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=300)
    # When one worker is SIGKILLed mid-batch, with tasks in its hands
    wait_for(lambda: batch.completed >= 20, timeout_s=30, what="20 samples")
    wait_for(lambda: tasks_received(doomed) >= 4, timeout_s=10, what="the doomed worker busy")
    doomed.kill()
    assert batch.completed < 100, "the batch finished before the worker could be killed"
    # (60 s bounds a hang, a tenth of the visibility timeout: kombu's redelivery cannot pass)
    outcomes = batch.outcomes(timeout=60)
    # Then every sample is scored and right (the dead worker's heartbeat lapses after 15 s)
    for i, (sample, outcome) in enumerate(zip(samples, outcomes, strict=True)):
        assert outcome.status == "ok", (i, outcome)
        assert outcome.score == expected(app, "j", sample), (i, outcome)
    # because the client resubmitted what the dead worker had started
    assert batch.resubmitted > 0
    assert survivor.proc.poll() is None


def test_vanished_worker_holding_retries_is_resubmitted(tmp_path, redis_url, stack):
    # Given a judge that is down for now (its port reserved), a fixed 6 s retry backoff, and
    # one worker that takes every task and every retry message (ETA) of a batch
    port = free_port()
    backend = judge_backend(f"http://127.0.0.1:{port}", concurrency=8)
    backend["retry"].update(attempts=5, backoff_base_s=6.0, backoff_cap_s=6.0, jitter=False)
    config_path = write_config(
        tmp_path, {"j": backend}, redis_url=redis_url, fallback_score=FALLBACK,
        visibility_timeout_s=600,
    )
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    (doomed,) = start_workers(config_path, [("j", "doomed@retry")])
    stack.callback(doomed.kill)
    samples = samples_for(8, "held")
    deadline_s = 25
    batch = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=deadline_s)
    try:  # a broken precondition must not pass for the expected failure
        # (the 8 samples are one chunk: its task, then its retry)
        wait_for(lambda: tasks_received(doomed) >= 2, timeout_s=5, what="retries reserved")
    except AssertionError as exc:
        raise RuntimeError(exc) from None
    # When that worker dies while holding the retries, and the judge and a new worker come up
    doomed.kill()
    stack.enter_context(spawn(MockJudgeSettings(latency_ms=20, port=port)))
    (survivor,) = start_workers(config_path, [("j", "survivor@retry")])
    stack.callback(survivor.kill)
    outcomes = batch.outcomes()
    # Then the held work is sent again (the dead worker's heartbeat lapses after 15 s), all of
    # it scored before the deadline (a sample still out at the deadline is a timeout)
    assert [o.status for o in outcomes] == ["ok"] * 8, [o.error for o in outcomes]
    assert [o.score for o in outcomes] == [expected(app, "j", s) for s in samples]
    assert batch.resubmitted > 0
