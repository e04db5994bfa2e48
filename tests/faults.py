"""Faults a deployment meets, each run against a batch of 2,000 samples: how many judge calls
were bought twice (the mock judge's own request counter minus the samples) and how many
samples were lost. Used by tests/e2e/test_chaos.py (which asserts the bounds) and by
benchmarks/duplicates.py (which prints the figures).

Everything runs on a private redis-server without persistence (a restart loses all), three
`qrq worker` processes of 6 calls each, chunks of 64 samples (as the planner makes them for a
large batch) and a judge at ~100 ms a call (~180 samples/s).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from support import PrivateRedis, expected, judge_backend, start_workers, wait_for, write_config

import qreward_queue
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn

FAULTS = ("worker_kill", "redis_restart", "redis_outage")
SAMPLES = 2000
OUTAGE_S = 60.0


def inject(fault: str, server: PrivateRedis, workers: list) -> None:
    if fault == "worker_kill":  # two of the three workers, main process and all, at once
        for worker in workers[:2]:
            worker.kill()
    elif fault == "redis_restart":  # SIGKILL, back empty 3 s later
        server.kill()
        time.sleep(3)
        server.start()
    elif fault == "redis_outage":  # frozen (no answer, data kept) for a minute
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(OUTAGE_S)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
    else:
        raise ValueError(f"unknown fault {fault!r} (known: {', '.join(FAULTS)})")


def run_fault(fault: str, directory: Path, samples: int = SAMPLES) -> dict:
    """Score `samples` samples, inject `fault` once a quarter is done; the figures."""
    with contextlib.ExitStack() as stack:
        server = PrivateRedis(directory).start()
        stack.callback(server.kill)
        judge = stack.enter_context(spawn(MockJudgeSettings(latency_ms=100, latency_cv=0.2)))
        config_path = write_config(
            directory, {"j": judge_backend(judge.url, concurrency=2, calls=6, chunk_size=64)},
            redis_url=server.url,
        )
        app = qreward_queue.configure(qreward_queue.load_config(config_path))
        workers = start_workers(config_path, [("j", f"w{i}@{fault}") for i in range(3)])
        for worker in workers:
            stack.callback(worker.kill)
        batch_samples = [{"prompt": f"{fault} question {i}", "response": f"answer {i}"}
                         for i in range(samples)]
        started = time.monotonic()
        batch = qreward_queue.submit_batch(batch_samples, route="j", app=app, deadline_s=400)
        # the client waits as a trainer does, polling (results not yet read are Redis data a
        # restart loses: their samples would rightly be scored again)
        wait_for(lambda: batch.completed >= samples // 4, 120, "a quarter done")
        inject(fault, server, workers)
        outcomes = batch.outcomes(timeout=380)
        calls = judge.stats()["requests"]
        lost = sum(o.status != "ok" or o.score != expected(app, "j", s)
                   for s, o in zip(batch_samples, outcomes, strict=True))
        return {"fault": fault, "samples": samples, "judge_calls": calls,
                "duplicates": calls - samples, "lost": lost,
                "wall_s": round(time.monotonic() - started, 1),
                "resubmitted_tasks": batch.resubmitted}
