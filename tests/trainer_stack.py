"""A qrq stack for the trainer-integration tests: real Redis, a real `qrq worker`, mock judge.

The judge backend is named "judge" (a one-backend route of the same name), with a short HTTP
timeout so `[[mock:hang]]` samples end as errors or timeouts within a few seconds; the
"exact" function backend scores with exact_match (reference = the last number).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from support import expected, function_backend, judge_backend, start_workers, write_config

import qreward_queue
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn

FALLBACK = -1.0  # no judge gives it, so a silently zeroed reward would show


def start_stack(stack: contextlib.ExitStack, tmp_path: Path, redis_url: str,
                backends: tuple[str, ...] = ("judge",), latency_ms: float = 20):
    """Start the mock judge and one worker per backend; returns (app, judge, workers)."""
    judge = stack.enter_context(spawn(MockJudgeSettings(latency_ms=latency_ms, latency_cv=0.3,
                                                        hang_s=20)))
    definitions = {
        "judge": {**judge_backend(judge.url, concurrency=16, timeout_s=1.0),
                  "retry": {"attempts": 2, "backoff_base_s": 0.05, "backoff_cap_s": 0.2}},
        "exact": function_backend("qreward_queue.rewards.basic:exact_match"),
    }
    config = write_config(tmp_path, {b: definitions[b] for b in backends}, redis_url,
                          route=backends[0], fallback_score=FALLBACK, deadline_s=60)
    workers = start_workers(config, [(b, f"{b}@test") for b in backends])
    for worker in workers:
        stack.callback(worker.kill)
    app = qreward_queue.configure(config)
    return app, judge, workers


def judge_score(app, sample: dict) -> float:
    """The mock judge's verdict on what the "judge" backend sends for `sample`."""
    return expected(app, "judge", sample)
