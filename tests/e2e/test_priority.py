"""Validation overtakes a training backlog (DESIGN.md section 5), on real Redis and a real worker.

One worker (2 chunk tasks and 4 calls at once) scores on a slow mock judge (100 ms per call, no
limits); the planner cuts the backlog into chunks of 4 samples (one round of the worker's
calls). A backlog of 600 training samples is queued; once about 20 are done, a 16-sample
validation batch is submitted. It must finish while at least 80% of the backlog is
still pending. A negative control sends the same batch at the training priority and shows
that it then waits behind the backlog, so the test measures priority and nothing else.

At 4 calls in flight and 100 ms each, the worker does about 40 samples/s: validation sent at
priority 0 should be done in about 4 rounds (~0.5 s, ~20 backlog samples); the backlog's first
20% (120 samples) takes about 3 s, so the two outcomes are far apart.
"""

from __future__ import annotations

import time

from support import Worker, judge_backend, wait_for, write_config

import qreward_queue
from qreward_queue.backends.judge import JudgeBackend
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn, verdict

BACKLOG = 600
VAL = 16
STARTED_BEFORE_VAL = 20
BUDGET = BACKLOG // 5  # validation must finish before 20% of the backlog is done


def race(tmp_path, redis_url, val_priority: str) -> dict:
    """Run the scenario; report who crossed the line first and the backlog count then."""
    with spawn(MockJudgeSettings(latency_ms=100, latency_cv=0)) as judge:
        backend = judge_backend(judge.url, max_concurrent=0, concurrency=2, calls=4)  # no limiter
        config_path = write_config(tmp_path, {"slow": backend}, redis_url=redis_url)
        app = qreward_queue.configure(qreward_queue.load_config(config_path))
        backlog_samples = [
            {"prompt": f"train {i}", "response": f"rollout {i}"} for i in range(BACKLOG)
        ]
        val_samples = [{"prompt": f"val {i}", "response": f"answer {i}"} for i in range(VAL)]
        # the backlog is queued before the worker starts, so "20 done" is not overshot
        backlog = qreward_queue.submit_batch(
            backlog_samples, route="slow", priority="train", deadline_s=300, app=app
        )
        with Worker(config_path, "slow") as worker:
            wait_for(
                lambda: backlog.completed >= STARTED_BEFORE_VAL,
                timeout_s=60,
                what=f"{STARTED_BEFORE_VAL} backlog samples",
            )
            sent_at_completed = backlog.completed
            started = time.monotonic()
            val = qreward_queue.submit_batch(
                val_samples, route="slow", priority=val_priority, deadline_s=300, app=app
            )

            def finish_line():
                # Conservative both ways: when validation is seen done, the backlog is counted
                # after it; when the backlog is seen past the budget, validation is checked after.
                if val.done():
                    return "val", backlog.completed
                completed = backlog.completed
                if completed > BUDGET and not val.done():
                    return "backlog", completed
                return None

            winner, backlog_completed = wait_for(finish_line, timeout_s=60, what="the race")
            elapsed = time.monotonic() - started
            val_outcomes = val.outcomes(timeout=0.1) if winner == "val" else None
            worker.stop()
        print(
            f"val sent at priority {val_priority!r} after {sent_at_completed} backlog samples; "
            f"{winner} first after {elapsed:.2f} s with {backlog_completed} backlog samples done"
        )
        return {
            "winner": winner,
            "backlog_completed": backlog_completed,
            "sent_at_completed": sent_at_completed,
            "elapsed_s": elapsed,
            "val_samples": val_samples,
            "val_outcomes": val_outcomes,
            "judge": JudgeBackend(app.qrq_config.backend("slow")),
        }


def test_validation_overtakes_training_backlog(tmp_path, redis_url):
    # Given a backlog of 600 training samples, 20 of them done
    # When a 16-sample validation batch is submitted at priority "val"
    result = race(tmp_path, redis_url, val_priority="val")
    # Then it finishes while at least 80% of the backlog is still pending
    assert result["winner"] == "val", result
    assert result["backlog_completed"] <= BUDGET, result
    # and it was really scored, not timed out
    judge = result["judge"]
    for sample, outcome in zip(result["val_samples"], result["val_outcomes"], strict=True):
        assert outcome.status == "ok", outcome
        assert outcome.score == verdict(judge.render(sample))


def test_negative_control_same_batch_at_train_priority_waits(tmp_path, redis_url):
    # Given the same backlog and the same validation batch, sent at the training priority
    result = race(tmp_path, redis_url, val_priority="train")
    # Then it queues behind the backlog: 20% of the backlog is done before it finishes
    assert result["winner"] == "backlog", result
    assert result["backlog_completed"] > BUDGET, result
