"""Nothing is lost when a worker dies (DESIGN.md section 6), on real Redis and real workers.

Two ways a worker dies:
- the whole worker is SIGKILLed (main process and pool): its unacked messages come back after
  the visibility timeout, when a surviving worker's restore sweep finds them (the client's
  liveness check may resubmit them sooner; either way nothing may be missing);
- one prefork pool child is SIGKILLed: the main process sees WorkerLostError and the task runs
  again within seconds (task_reject_on_worker_lost / task_retry_on_worker_lost, delayed by the
  task's default_retry_delay), whatever the visibility timeout.
"""

from __future__ import annotations

import os
import re
import signal
import time

from support import (
    Worker,
    child_pids,
    function_backend,
    judge_backend,
    pid_alive,
    wait_for,
    write_config,
)

import qreward_queue
from qreward_queue.backends.judge import JudgeBackend
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn, verdict

FALLBACK = -1.0
VISIBILITY_TIMEOUT_S = 10
# kombu's restore sweep runs every unacked_restore_interval (10 s) x unacked_restore_throttle
# (qrq sets 1) and restores messages delivered more than the visibility timeout ago. A message
# delivered just before the kill is therefore back in the queue at most VT + 10 s later, and
# then takes one judge call (~0.2 s, lognormal). The rest of the batch (~140 samples on the
# surviving worker at ~40/s, ~4 s) runs meanwhile. 5 s of slack covers a loaded 2-core box.
RESTORE_SWEEP_S = 10
REDELIVERED_WORK_S = 1
SLACK_S = 5
BOUND_AFTER_KILL_S = VISIBILITY_TIMEOUT_S + RESTORE_SWEEP_S + REDELIVERED_WORK_S + SLACK_S


def in_flight_task_ids(log_text: str) -> set[str]:
    """Tasks the worker's log shows as received but not finished."""
    received = set(re.findall(r"Task qrq\.score_chunk\[([0-9a-f-]+)\] received", log_text))
    finished = set(
        re.findall(r"Task qrq\.score_chunk\[([0-9a-f-]+)\] (?:succeeded|failed|retry)", log_text)
    )
    return received - finished


def test_nothing_lost_when_a_whole_worker_is_killed(tmp_path, redis_url):
    # Given two workers of one judge backend (~200 ms per call) and a short visibility timeout
    with spawn(MockJudgeSettings(latency_ms=200, latency_cv=0.3)) as judge:
        config_path = write_config(
            tmp_path,
            {"j": judge_backend(judge.url, concurrency=8)},
            redis_url=redis_url,
            visibility_timeout_s=VISIBILITY_TIMEOUT_S,
            fallback_score=FALLBACK,
        )
        app = qreward_queue.configure(qreward_queue.load_config(config_path))
        samples = [{"prompt": f"q {i}", "response": f"a {i}"} for i in range(200)]
        with (
            Worker(config_path, "j", name="j1@%h") as doomed,
            Worker(config_path, "j", name="j2@%h") as survivor,
        ):
            started = time.monotonic()
            batch = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=120)
            # When one worker is SIGKILLed once ~30% of the batch is done
            wait_for(lambda: batch.completed >= 60, timeout_s=60, what="30% of the batch")
            doomed.kill()
            killed = time.monotonic()
            lost = in_flight_task_ids(doomed.log.read_text())
            assert lost, "the killed worker had no task in flight: the test proves nothing"
            # Then every sample still comes back scored, within the stated bound
            outcomes = batch.outcomes(timeout=BOUND_AFTER_KILL_S)
            after_kill = time.monotonic() - killed
            assert survivor.proc.poll() is None
            redelivered = {i for i in lost if f"[{i}] received" in survivor.log.read_text()}
        print(
            f"{len(lost)} task(s) in flight on the killed worker, {len(redelivered)} of them "
            f"redelivered by the visibility timeout (the rest resubmitted by the client); "
            f"batch done {after_kill:.1f} s after the kill, {time.monotonic() - started:.1f} s "
            f"in all"
        )
        # deadline promise: a dead worker's messages are back within the visibility timeout + sweep
        assert after_kill < BOUND_AFTER_KILL_S
        assert len(outcomes) == len(samples)
        judge_client = JudgeBackend(app.qrq_config.backend("j"))
        for i, (sample, outcome) in enumerate(zip(samples, outcomes, strict=True)):
            assert outcome.status == "ok", (i, outcome)
            assert outcome.score == verdict(judge_client.render(sample)), (i, outcome)
        # and the lost calls really were made again (every sample was answered at least once)
        assert judge.stats()["accepted"] >= len(samples)


def test_killed_pool_child_task_is_redelivered_and_scored(tmp_path, redis_url):
    # Given a prefork function worker (default visibility timeout: 900 s) and one slow sample
    # whose reward function writes down the pid of the pool child running it
    config_path = write_config(
        tmp_path,
        {"slowfn": function_backend("tests.support:recording_exact_match", chunk_size=1)},
        redis_url=redis_url,
        fallback_score=FALLBACK,
    )
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    assert app.qrq_config.visibility_timeout_s >= 900
    pid_file = tmp_path / "pids"
    sample = {
        "prompt": "2 + 2 = ?",
        "response": "It is 4.",
        "reference": "#### 4",
        "extra": {"pid_file": str(pid_file), "sleep_s": 1.5},
    }
    with Worker(config_path, "slowfn") as worker:
        started = time.monotonic()
        batch = qreward_queue.submit_batch([sample], route="slowfn", app=app, deadline_s=120)
        first = int(
            wait_for(
                lambda: pid_file.exists() and pid_file.read_text().split(),
                timeout_s=30,
                what="the reward function to start",
            )[0]
        )
        assert first in child_pids(worker.proc.pid), "not a pool child of the worker"
        # When that pool child is SIGKILLed mid-task
        os.kill(first, signal.SIGKILL)
        # Then the task runs again in another child and is scored, long before the VT: a killed
        # child is noticed within ~5 s (celery-redis-notes section 3), the retry waits 2 s, the
        # sample runs again: ~9 s (the batch's 120 s deadline bounds a hang, far below the 900 s
        # after which kombu would redeliver the message)
        (outcome,) = batch.outcomes()
        elapsed = time.monotonic() - started
        assert outcome.status == "ok", outcome
        assert outcome.score == 1.0
        runs = [int(p) for p in pid_file.read_text().split()]
        assert len(runs) >= 2 and runs[0] == first and runs[-1] != first, runs
        assert not pid_alive(first)
        # and the worker itself lives on and noticed the loss
        assert worker.proc.poll() is None
        log = worker.log.read_text()
        assert "WorkerLostError" in log or "signal 9" in log, log[-3000:]
        print(f"pool child {first} killed; scored by {runs[-1]} after {elapsed:.1f} s")
