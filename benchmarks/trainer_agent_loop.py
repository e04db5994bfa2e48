"""verl's agent-loop shape on the S1 judge: per-sample callers in many processes, in one run.

    python benchmarks/trainer_agent_loop.py [--json] [--processes 8] [--coroutines 128]
                                            [--redis-url redis://127.0.0.1:6379/13]

The judge is S1's (3000 rpm = 50/s, 64 in flight, 200 ms mean latency, cv 0.5); qrq runs
2 `qrq worker` processes x 32 threads (backend file: rpm 3000, max_concurrent 64). Clients:
  verl_adapter     `processes` spawned processes (verl's reward workers), each with
                   `coroutines` concurrent coroutines scoring one sample each through
                   `qreward_queue.integrations.verl.compute_score` (keyword call, as verl's
                   naive manager makes it); the per-process micro-batcher sends the batches.
  submit_batch     the same samples as one submit_batch from one process.
  verl_rate_limited  the baseline: verl's rate-limited manager style (in-process RPM bucket +
                   semaphore(64) + timeout, failures a silent 0.0) in each of `processes`
                   processes, each configured with the judge's full limit, as verl does.
  verl_light       the judge not saturated: 4 coroutines each awaiting one sample at a time
                   through compute_score (64 samples); p50/p99 are each call's own wait.
  judge_light      its reference: the same 4-at-a-time calls straight to the judge (aiohttp).
Columns as in flow_control.py; the JSON lines add `client_cpu_ms_per_sample` (CPU time of the
trainer processes over the scoring, poller and flusher threads included, per sample),
`groups` (Celery groups published, i.e. submit_batch calls) and `lost` (samples with no
answer at all). Small run: --processes 2 --coroutines 16.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import baselines
from common import (
    BACKEND,
    QrqWorker,
    Run,
    SampleResult,
    flush_redis,
    judge_config,
    percentile,
    run_scenarios,
    score_results,
    start_qrq_workers,
    write_config,
)

import qreward_queue
from qreward_queue.cli.demo import expected_scores, grpo_batch
from qreward_queue.integrations.coerce import make_sample
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn
from qreward_queue.trainer.batcher import default_batcher

SERVER_RPM, SERVER_CONCURRENT, LATENCY_MS, LATENCY_CV = 3000, 64, 200.0, 0.5
WORKERS, WORKER_THREADS = 2, 32
REFILL_S = 1.5
LIGHT_CALLERS, LIGHT_SAMPLES = 4, 64  # the unsaturated phase: 4 callers, one sample at a time


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def verl_rows(n: int) -> list[dict]:
    """What verl hands compute_score per trajectory (the grpo_batch samples)."""
    return [{"data_source": s["data_source"], "solution_str": s["response"],
             "ground_truth": s["reference"], "extra_info": {"question": s["prompt"]}}
            for s in grpo_batch(n_prompts=math.ceil(n / 8))[:n]]


def as_sample(row: dict) -> dict:
    return make_sample(row["extra_info"]["question"], row["solution_str"], row["ground_truth"],
                       row["data_source"], row["extra_info"])


# ----------------------------------------------------------------- one trainer process each
def _trainer(kind: str, config_path: str, rows: list[dict], barrier, queue, index: int) -> None:
    """Get ready, wait for the others, score `rows`, report (results, cpu_s, groups)."""
    started = time.time()
    try:
        config = qreward_queue.load_config(config_path)
        if kind == "verl_adapter":
            from qreward_queue.integrations import verl

            qreward_queue.configure(config)

            async def agent_loop():
                return await asyncio.gather(*(verl.compute_score(**r, route=BACKEND)
                                              for r in rows))
            barrier.wait()
            started, cpu0 = time.time(), time.process_time()
            dicts = asyncio.run(agent_loop())
            results = [SampleResult(d["score"], d["qrq_ok"] == 1.0, 0.0, d["qrq_ok"] != 1.0)
                       for d in dicts]
            groups = default_batcher().batches_sent
        elif kind == "verl_light":
            from qreward_queue.integrations import verl

            qreward_queue.configure(config)

            async def one_by_one(part: list[int]) -> None:
                for i in part:
                    begun = time.perf_counter()
                    d = await verl.compute_score(**rows[i], route=BACKEND)
                    timed[i] = (d, (time.perf_counter() - begun) * 1000)

            async def light_loop():
                await asyncio.gather(*(one_by_one(list(range(k, len(rows), LIGHT_CALLERS)))
                                       for k in range(LIGHT_CALLERS)))
            timed: list = [None] * len(rows)
            barrier.wait()
            started, cpu0 = time.time(), time.process_time()
            asyncio.run(light_loop())
            results = [SampleResult(d["score"], d["qrq_ok"] == 1.0, ms, d["qrq_ok"] != 1.0)
                       for d, ms in timed]
            groups = default_batcher().batches_sent
        elif kind == "judge_light":
            samples = [as_sample(r) for r in rows]
            barrier.wait()
            started, cpu0 = time.time(), time.process_time()
            results = baselines.async_semaphore(config.backend(BACKEND), samples, LIGHT_CALLERS)
            groups = 0
        elif kind == "submit_batch":
            app = qreward_queue.configure(config)
            barrier.wait()
            started, cpu0 = time.time(), time.process_time()
            outcomes = qreward_queue.submit_batch([as_sample(r) for r in rows], route=BACKEND,
                                                  app=app).outcomes()
            results = [SampleResult(o.score, o.scored, o.latency_ms or 0.0, not o.scored)
                       for o in outcomes]
            groups = 1
        else:
            samples = [as_sample(r) for r in rows]
            barrier.wait()
            started, cpu0 = time.time(), time.process_time()
            results = baselines.three_layer(config.backend(BACKEND), samples, rpm=SERVER_RPM,
                                            tpm=None, max_concurrent=SERVER_CONCURRENT)
            groups = 0
        cpu = time.process_time() - cpu0
    except Exception as exc:  # report it: the parent must not wait for a dead trainer
        barrier.abort()
        queue.put((index, started, time.time(), None, f"{type(exc).__name__}: {exc}", 0))
        return
    queue.put((index, started, time.time(), [tuple(vars(r).values()) for r in results], cpu,
               groups))


def run_client(env: dict, client: str, rows: list[dict], processes: int, trainer=_trainer,
               expected: list[float] | None = None) -> Run:
    """`processes` spawned `trainer(client, config_path, rows, barrier, queue, index)`s score
    `rows` between them; `expected`: the right scores (default: the judge's of `as_sample`)."""
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(processes + 1), ctx.Queue()
    share = math.ceil(len(rows) / processes)
    procs = [ctx.Process(target=trainer, args=(client, str(env["config_path"]),
                                               rows[i * share:(i + 1) * share], barrier, queue, i))
             for i in range(processes)]
    for p in procs:
        p.start()
    env["mock"].reset()
    time.sleep(REFILL_S)  # the judge's and the limiter's one-second buckets refill
    cpu0 = sum(w.cpu_s() for w in env["workers"])
    with suppress(Exception):  # a trainer failed first; its report says why
        barrier.wait(180)
    reports = sorted((queue.get(timeout=900) for _ in procs), key=lambda r: r[0])
    worker_cpu = sum(w.cpu_s() for w in env["workers"]) - cpu0
    for p in procs:
        p.join(30)
    failed = [r[4] for r in reports if r[3] is None]
    if failed:
        raise RuntimeError(f"{len(failed)} trainer process(es) failed: {failed[0]}")
    wall = max(r[2] for r in reports) - min(r[1] for r in reports)
    results = [SampleResult(*t) for r in reports for t in r[3]]
    stats = env["mock"].stats()
    if expected is None:
        samples = [as_sample(r) for r in rows]
        expected = expected_scores(env["config"], samples, [BACKEND] * len(samples))
    not_ok, wrong = score_results(results, expected)
    latencies = [r.latency_ms for r in results if r.ok and r.latency_ms]
    requests = stats["requests"]
    return Run(
        scenario="agent_loop", client=client, n=len(rows), wall_s=wall,
        limit_per_s=SERVER_RPM / 60, server_429=stats["rate_limited"], server_requests=requests,
        not_ok=not_ok, wrong=wrong, p50_ms=percentile(latencies, 50),
        p99_ms=percentile(latencies, 99),
        worker_cpu_ms_per_request=worker_cpu * 1000 / requests if env["workers"]
        and requests else None,
        extra={"processes": processes if client != "submit_batch" else 1,
               "lost": len(rows) - len(results),
               "client_cpu_ms_per_sample": round(sum(r[4] for r in reports) * 1000 / len(rows), 3),
               "groups": sum(r[5] for r in reports)})


def scenario(args) -> tuple[list[Run], list[str]]:
    rows = verl_rows(args.processes * args.coroutines)
    flush_redis(args.redis_url)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="qrq-bench-") as tmp, spawn(
        MockJudgeSettings(rpm=SERVER_RPM, max_concurrent=SERVER_CONCURRENT,
                          latency_ms=LATENCY_MS, latency_cv=LATENCY_CV)) as mock:
        config_path = write_config(Path(tmp), {BACKEND: judge_config(
            mock.url, rpm=SERVER_RPM, max_concurrent=SERVER_CONCURRENT,
            calls=WORKER_THREADS)}, redis_url=args.redis_url, deadline_s=600)
        config = qreward_queue.load_config(config_path)
        app = qreward_queue.configure(config)
        log(f"starting {WORKERS} qrq workers x {WORKER_THREADS} threads")
        workers: list[QrqWorker] = start_qrq_workers(
            config_path, [(BACKEND, f"w{i + 1}") for i in range(WORKERS)], app)
        env = {"mock": mock, "config_path": config_path, "config": config, "workers": workers}
        try:
            for client, processes in [("verl_adapter", args.processes), ("submit_batch", 1)]:
                log(f"{client}: {len(rows)} samples from {processes} process(es)")
                runs.append(run_client(env, client, rows, processes))
            log(f"verl_light: {LIGHT_CALLERS} per-sample callers, one sample at a time")
            runs.append(run_client(env, "verl_light", rows[:LIGHT_SAMPLES], 1))
        finally:
            for w in workers:
                w.stop()
        env["workers"] = []
        log(f"verl_rate_limited: {args.processes} processes")
        runs.append(run_client(env, "verl_rate_limited", rows, args.processes))
        log(f"judge_light: {LIGHT_CALLERS} direct callers, one sample at a time")
        runs.append(run_client(env, "judge_light", rows[:LIGHT_SAMPLES], 1))
    notes = [f"{r.client}: client CPU {r.extra['client_cpu_ms_per_sample']} ms/sample, "
             f"{r.extra['groups']} groups, {r.extra['lost']} lost" for r in runs]
    notes.append(f"verl_light / judge_light: {LIGHT_CALLERS} callers each awaiting one sample "
                 f"at a time (judge not saturated); p50/p99 = each call's own wait, through "
                 f"qrq's per-sample path vs straight to the judge")
    return runs, notes


def targets(runs: list[Run]) -> list[tuple[str, bool, str]]:
    by = {r.client: r for r in runs}
    out = []
    r = by.get("verl_adapter")
    if r is not None:
        cpu = r.extra["client_cpu_ms_per_sample"]
        out += [("verl adapter throughput >= 100% of the limit", r.fraction_of_limit >= 1.0,
                 f"{r.fraction_of_limit:.1%}"),
                ("verl adapter client CPU <= 3 ms per sample", cpu <= 3.0, f"{cpu} ms"),
                ("verl adapter 429s <= 1% of requests", r.pct_429 <= 1.0,
                 f"{r.server_429}/{r.server_requests} = {r.pct_429:.2f}%"),
                ("verl adapter 0 wrong, 0 lost", r.wrong == 0 and r.extra["lost"] == 0,
                 f"wrong {r.wrong}, lost {r.extra['lost']}")]
        light, judge = by.get("verl_light"), by.get("judge_light")
        if light is not None and judge is not None and light.p50_ms and judge.p50_ms:
            ratio = light.p50_ms / judge.p50_ms
            out.append(("per-sample caller p50 <= 1.3x the judge's own p50 (not saturated)",
                        ratio <= 1.3, f"{light.p50_ms:.0f} ms vs {judge.p50_ms:.0f} ms = "
                                      f"{ratio:.2f}x"))
        for other in ("submit_batch", "verl_rate_limited"):
            if other in by and by[other].ok_per_s > 0:
                out.append((f"verl adapter / {other} (ok samples/s)", True,
                            f"{r.ok_per_s / by[other].ok_per_s:.2f}x"))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="also one JSON line per run")
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--coroutines", type=int, default=128)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/13")
    args = parser.parse_args(argv)
    args.scenario = "agent_loop"
    print(f"qrq trainer agent-loop benchmark: {args.processes} processes x {args.coroutines} "
          f"coroutines, Redis at {args.redis_url} (flushed), judge 3000 rpm / 64 / 200 ms")
    run_scenarios({"agent_loop": ("verl agent-loop shape on the S1 judge", scenario)}, args,
                  targets)


if __name__ == "__main__":
    main()
