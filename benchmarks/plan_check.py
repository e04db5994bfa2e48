"""`qrq plan` against measured wall time, in one run: predicted, measured, error %.

    python benchmarks/plan_check.py [--scenario S1|TPM|S4|demo|all] [--n N] [--redis-url URL]
                                    [--json]

S1   flow_control's S1: one judge, 3000 rpm, 64 in flight, 200 ms mean latency (cv 0.5);
     2 `qrq worker` x 32 threads; binding limit: rpm.
TPM  one judge whose tokens/min bind: 150,000 tpm (and 6000 rpm), the same latency; the backend
     file says the same; 1 worker x 32 threads; binding limit: tpm.
S4   routes' S4: route of judges at 1200 + 2400 + 3600 rpm, one worker each sized
     2 x (rpm/60) x latency; binding limit: rpm of each.
demo `qrq demo` itself (embedded, the example configuration shipped with qrq: two judges of
     6000 rpm at 25 ms): its qrq row against `qrq plan -n 1024 --latency-ms 25` (a plan once
     promised 247 samples/s there, above the judges' summed 200/s). --n and --redis-url do not
     apply; it runs the demo's naive and asyncio clients too (about 40 s).
The plan reads the very backend files the workers run, the batch's mean prompt/response
tokens, the judge's configured mean latency and --cores (default: this machine's). Also
printed: `cpu_share`, the cores the workers really got (their CPU time over the wall time),
which shows when other jobs on a shared machine starve them. Target: |error| <= 15% on each.
Uses the Redis database of --redis-url (flushed per scenario).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REDIS_URL, flush_redis, judge_config, start_qrq_workers, write_config

import qreward_queue
from qreward_queue.cli.demo import DEMO_LATENCY_MS, grpo_batch
from qreward_queue.config.model import PACKAGED_CONFIG
from qreward_queue.ops.plan import Workload, plan_route
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn

LATENCY_MS = 200.0
TARGET_ERROR = 0.15

# name -> (judges {backend: (server rpm, server tpm, worker threads)}, workers per backend, n)
SCENARIOS = {
    "S1": ({"judge": (3000, 0, 32)}, 2, 1024),
    "TPM": ({"judge": (6000, 150_000, 32)}, 1, 512),
    "S4": ({"j1200": (1200, 0, 8), "j2400": (2400, 0, 16), "j3600": (3600, 0, 24)}, 1, 1024),
}


def token_means(samples: list[dict]) -> tuple[float, float]:
    """Mean prompt (with reference) and response tokens, as the plan's ~4 characters a token."""
    prompt = sum(len(s["prompt"]) + len(s.get("reference") or "") for s in samples) / len(samples)
    response = sum(len(s["response"]) for s in samples) / len(samples)
    return prompt / 4, response / 4


def run_demo_case(cores: int) -> dict:
    """`qrq demo` in a fresh directory, its qrq row against the plan of the same step."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QRQ_")}
    with tempfile.TemporaryDirectory(prefix="qrq-plan-demo-") as tmp:
        out = subprocess.run([sys.executable, "-m", "qreward_queue.cli", "demo"], cwd=tmp,
                             env=env, capture_output=True, text=True, timeout=600, check=True)
    (row,) = [line.split() for line in out.stdout.splitlines() if line.startswith("qrq ")]
    wall, not_ok = float(row[1]), int(row[5])
    samples = grpo_batch()
    config = qreward_queue.load_config(PACKAGED_CONFIG)
    work = Workload(len(samples), *token_means(samples), DEMO_LATENCY_MS / 1000, cores=cores)
    plan = plan_route(config, "demo", work)
    return {
        "scenario": "demo", "n": len(samples), "measured_s": wall,
        "predicted_s": round(plan.wall_s, 2), "error_pct": _error_pct(plan.wall_s, wall),
        "binding": {p.backend: p.binding for p in plan.backends}, "cores": cores,
        "cpu_share": None, "not_ok": not_ok, "worker_cpu_ms_per_sample": None,  # in-process
        "predicted_per_s": round(len(samples) / plan.wall_s, 1),
    }


def run(name: str, n: int, redis_url: str, cores: int) -> dict:
    if name == "demo":
        return run_demo_case(cores)
    judges, workers, default_n = SCENARIOS[name]
    n = n or default_n
    samples = grpo_batch(n_prompts=math.ceil(n / 8))[:n]
    flush_redis(redis_url)
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="qrq-plan-")))
        backends = {}
        for backend, (rpm, tpm, threads) in judges.items():
            mock = stack.enter_context(spawn(MockJudgeSettings(
                rpm=rpm, tpm=tpm, max_concurrent=64, latency_ms=LATENCY_MS, latency_cv=0.5)))
            backends[backend] = judge_config(mock.url, rpm=rpm, max_concurrent=64,
                                             calls=threads)
            if tpm:
                backends[backend]["limits"]["tpm"] = tpm
        route = "step"
        config_path = write_config(tmp, backends, redis_url=redis_url,
                                   routes={route: list(judges)})
        config = qreward_queue.load_config(config_path)
        app = qreward_queue.configure(config)
        prompt_tokens, response_tokens = token_means(samples)
        work = Workload(n, prompt_tokens, response_tokens, LATENCY_MS / 1000,
                        workers={b: workers for b in judges}, cores=cores)
        plan = plan_route(config, route, work)
        specs = [(b, f"{b}-{i}") for b in judges for i in range(workers)]
        running = start_qrq_workers(config_path, specs, app)
        for w in running:
            stack.callback(w.stop)
        time.sleep(1.5)  # the judges' buckets refill while the workers connect
        cpu0, started = sum(w.cpu_s() for w in running), time.perf_counter()
        outcomes = qreward_queue.submit_batch(samples, route=route, app=app).outcomes()
        wall = time.perf_counter() - started
        cpu = sum(w.cpu_s() for w in running) - cpu0
    per_backend = {b: sum(o.backend == b for o in outcomes) for b in judges}
    return {
        "scenario": name, "n": n, "measured_s": round(wall, 2),
        "predicted_s": round(plan.wall_s, 2), "error_pct": _error_pct(plan.wall_s, wall),
        "binding": {p.backend: p.binding for p in plan.backends},
        "cores": cores, "cpu_share": round(cpu / wall, 2),
        "not_ok": sum(o.status != "ok" for o in outcomes), "per_backend": per_backend,
        "worker_cpu_ms_per_sample": round(1000 * cpu / n, 2),
    }


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _error_pct(predicted: float, measured: float) -> float:
    return round(100 * (predicted - measured) / measured, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="all", choices=[*SCENARIOS, "demo", "all"])
    parser.add_argument("--n", type=int, default=0, help="samples (default: per scenario)")
    parser.add_argument("--redis-url", default=REDIS_URL)
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    names = [*SCENARIOS, "demo"] if args.scenario == "all" else [args.scenario]
    print(f"{'scenario':<9}{'n':>6}{'predicted_s':>12}{'measured_s':>11}{'error':>8}"
          f"{'cpu_share':>10}{'cpu_ms':>8}  binding")
    results = []
    for name in names:
        r = run(name, args.n, args.redis_url, args.cores)
        results.append(r)
        binding = ", ".join(f"{b}: {k}" for b, k in r["binding"].items())
        print(f"{name:<9}{r['n']:>6}{r['predicted_s']:>12.2f}{r['measured_s']:>11.2f}"
              f"{r['error_pct']:>7.1f}%{_num(r['cpu_share']):>10}"
              f"{_num(r['worker_cpu_ms_per_sample']):>8}  {binding}", flush=True)
        if args.json:
            print(json.dumps(r), flush=True)
    for r in results:
        ok = abs(r["error_pct"]) <= TARGET_ERROR * 100
        print(f"{'PASS' if ok else 'FAIL'}  {r['scenario']}: plan within "
              f"{TARGET_ERROR:.0%} of measured ({r['error_pct']:+.1f}%)")


if __name__ == "__main__":
    main()
