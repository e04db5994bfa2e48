"""Wrong configured limits: does qrq find the server's real limit?

    python benchmarks/wrong_limits.py [--scenario C|R|all] [--json]

C  concurrency: the backend file says 64 in flight (and rpm 6000), the mock judge allows 8
   (its rpm is 6000 too, so its 429s say requests are left); latency 100 ms mean (cv 0.5):
   the real limit is 8 / 0.1 s = 80 samples/s. 1,600 samples.
R  rpm: the file says rpm 6000, the judge allows 1800 (30/s), 64 in flight, latency 100 ms.
   900 samples.

qrq runs with 2 `qrq worker` processes, pooled by the docs' rule from the FILE's limits.
The baselines in the same run are asyncio + aiohttp Semaphore clients backing off on 429:
one with 64 (what the file suggests) and an oracle told the server's real concurrency.
The judge's counters are read at t = 10 s, so throughput and 429s are reported after the
first 10 s (when qrq has learned the limit) and overall.
Targets after 10 s: >= 95% of the real limit, < 2% 429. Never exits non-zero on a miss.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import baselines
from common import REDIS_URL, QrqWorker, flush_redis, judge_config, write_config

import qreward_queue
from qreward_queue.cli.demo import expected_scores, grpo_batch
from qreward_queue.config.model import Limits, advised_calls
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn

LATENCY_MS = 100.0
PROBE_S = 10.0
WORKERS = 2
FILE = {"rpm": 6000, "max_concurrent": 64}
SCENARIOS = {
    "C": ("concurrency: file 64 in flight, server 8", {"rpm": 6000, "max_concurrent": 8},
          8 / (LATENCY_MS / 1000), 1600),
    "R": ("rpm: file 6000, server 1800", {"rpm": 1800, "max_concurrent": 64}, 1800 / 60, 900),
}


def samples_for(n: int) -> list[dict]:
    base = grpo_batch(n // 8 + 1, 8)
    return [dict(base[i], id=i) for i in range(n)]


def run(name: str, client: str, judge, real_limit: float, fn) -> dict:
    judge.reset()
    time.sleep(1.5)  # the judge's one-second buckets refill
    at10: dict = {}
    timer = threading.Timer(PROBE_S, lambda: at10.update(judge.stats()))
    timer.start()
    started = time.perf_counter()
    wrong = fn()
    wall = time.perf_counter() - started
    timer.cancel()
    end = judge.stats()
    row = {"scenario": name, "client": client, "wall_s": round(wall, 2),
           "per_s": round(end["accepted"] / wall, 1),
           "fraction_of_limit": round(end["accepted"] / wall / real_limit, 3),
           "server_429_pct": round(100 * end["rate_limited"] / max(1, end["requests"]), 2),
           "wrong_or_lost": wrong}
    if at10:
        after = max(1e-9, wall - PROBE_S)
        req = end["requests"] - at10["requests"]
        row |= {"after10_fraction_of_limit":
                round((end["accepted"] - at10["accepted"]) / after / real_limit, 3),
                "after10_429_pct": round(100 * (end["rate_limited"] - at10["rate_limited"])
                                         / max(1, req), 2)}
    return row


def scenario(name: str, redis_url: str) -> list[dict]:
    title, server, real_limit, n = SCENARIOS[name]
    flush_redis(redis_url)
    settings = MockJudgeSettings(latency_ms=LATENCY_MS, latency_cv=0.5, **server)
    rows = []
    with tempfile.TemporaryDirectory(prefix="qrq-wrong-") as tmp, spawn(settings) as judge:
        calls = advised_calls(Limits(**FILE), LATENCY_MS / 1000, WORKERS)
        path = write_config(Path(tmp), {"judge": judge_config(judge.url, calls=calls, **FILE)},
                            redis_url=redis_url)
        app = qreward_queue.configure(path)
        backend = app.backend_config("judge")
        samples = samples_for(n)
        want = expected_scores(app.qrq_config, samples, ["judge"] * n)

        def semaphore(width: int):
            def client() -> int:
                got = baselines.async_semaphore(backend, samples, width)
                return sum(not r.ok or abs(r.score - w) > 1e-9
                           for r, w in zip(got, want, strict=True))
            return client

        def qrq() -> int:
            out = qreward_queue.submit_batch(samples, route="judge", app=app).outcomes()
            return sum(o.status != "ok" or abs(o.score - w) > 1e-9
                       for o, w in zip(out, want, strict=True))

        workers = [QrqWorker(path, "judge", f"w{i}", app) for i in range(WORKERS)]
        try:
            rows.append(run(name, "qrq", judge, real_limit, qrq))
        finally:
            for w in workers:
                w.stop()
        rows.append(run(name, "async_semaphore", judge, real_limit, semaphore(64)))
        oracle = server["max_concurrent"]
        rows.append(run(name, f"oracle_semaphore({oracle})", judge, real_limit, semaphore(oracle)))
    print(f"\n== {name}: {title}; real limit {real_limit:g}/s, {n} samples")
    print(f"{'client':<17}{'wall_s':>8}{'per_s':>8}{'of_limit':>9}{'429%':>7}"
          f"{'after10_of_limit':>17}{'after10_429%':>13}{'wrong/lost':>11}")
    for r in rows:
        print(f"{r['client']:<17}{r['wall_s']:>8.2f}{r['per_s']:>8.1f}"
              f"{r['fraction_of_limit']:>9.1%}{r['server_429_pct']:>6.1f}%"
              f"{r.get('after10_fraction_of_limit', 0):>17.1%}"
              f"{r.get('after10_429_pct', 0):>12.1f}%{r['wrong_or_lost']:>11}")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--redis-url", default=os.environ.get("QRQ_BENCH_REDIS_URL", REDIS_URL))
    args = parser.parse_args(argv)
    rows = []
    for name in SCENARIOS if args.scenario == "all" else [args.scenario]:
        rows += scenario(name, args.redis_url)
    print("\n== targets")
    for r in (r for r in rows if r["client"] == "qrq"):
        frac, pct = r.get("after10_fraction_of_limit", 0), r.get("after10_429_pct", 100)
        print(f"{'PASS' if frac >= 0.95 else 'FAIL'}  {r['scenario']}: >= 95% of the real limit "
              f"after 10 s: {frac:.1%}")
        print(f"{'PASS' if pct < 2 else 'FAIL'}  {r['scenario']}: < 2% 429 after 10 s: {pct}%")
        print(f"{'PASS' if r['wrong_or_lost'] == 0 else 'FAIL'}  {r['scenario']}: 0 wrong or "
              f"lost: {r['wrong_or_lost']}")
    if args.json:
        for r in rows:
            print(json.dumps(r))


if __name__ == "__main__":
    main()
