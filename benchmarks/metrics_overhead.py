"""What Prometheus metrics cost: a fast judge's throughput with worker metrics on vs off.

    python benchmarks/metrics_overhead.py [--n 1024] [--rounds 2] [--redis-url URL] [--json]

A mock judge without limits answers in 20 ms (cv 0.2); one `qrq worker` of 32 threads scores
`n` samples, started without metrics and then with `QRQ_METRICS_PORT` (a scrape every second
while it runs, as Prometheus would), alternately for `rounds` rounds so that drift on a shared
machine hits both. Prints samples/s and the worker's CPU per sample (from /proc: steadier than
wall time on a shared machine) per run, and the on/off ratios of the medians (target: the
metrics cost < 5%). Uses the Redis database of --redis-url, flushed per run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

import contextlib

from common import REDIS_URL, QrqWorker, flush_redis, judge_config, write_config
from support import free_port

import qreward_queue
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn

BACKEND = "judge"


def scrape_every_second(port: int, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        with contextlib.suppress(requests.RequestException):
            requests.get(f"http://127.0.0.1:{port}/metrics", timeout=2)


def one_run(mock_url: str, n: int, metrics_on: bool, redis_url: str, round_: int) -> dict:
    flush_redis(redis_url)
    with tempfile.TemporaryDirectory(prefix="qrq-metrics-bench-") as tmp:
        config_path = write_config(
            Path(tmp), {BACKEND: judge_config(mock_url, rpm=0, max_concurrent=0, calls=32)},
            redis_url=redis_url)
        app = qreward_queue.configure(qreward_queue.load_config(config_path))
        port = free_port()
        os.environ.pop("QRQ_METRICS_PORT", None)
        if metrics_on:
            os.environ["QRQ_METRICS_PORT"] = str(port)
        worker = QrqWorker(config_path, BACKEND, f"w{round_}{int(metrics_on)}", app)
        os.environ.pop("QRQ_METRICS_PORT", None)
        stop = threading.Event()
        if metrics_on:
            threading.Thread(target=scrape_every_second, args=(port, stop), daemon=True).start()
        samples = [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(n)]
        try:
            cpu0, started = worker.cpu_s(), time.perf_counter()
            outcomes = qreward_queue.submit_batch(samples, route=BACKEND, app=app).outcomes()
            wall = time.perf_counter() - started
            cpu_ms = (worker.cpu_s() - cpu0) * 1000 / n
            counted = None
            if metrics_on:
                text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
                counted = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                              if line.startswith("qrq_samples_total{"))
        finally:
            stop.set()
            worker.stop()
    return {"metrics": metrics_on, "round": round_, "n": n, "wall_s": round(wall, 3),
            "per_s": round(n / wall, 1), "worker_cpu_ms_per_sample": round(cpu_ms, 3),
            "not_ok": sum(o.status != "ok" for o in outcomes),
            "samples_counted": counted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--redis-url", default=REDIS_URL)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    runs = []
    with spawn(MockJudgeSettings(latency_ms=20, latency_cv=0.2)) as mock:
        for round_ in range(args.rounds):
            for on in (False, True):
                r = one_run(mock.url, args.n, on, args.redis_url, round_)
                runs.append(r)
                print(f"metrics {'on ' if on else 'off'}  round {round_}  {r['per_s']:>7.1f} "
                      f"samples/s  worker CPU {r['worker_cpu_ms_per_sample']:.2f} ms/sample  "
                      f"({r['wall_s']:.2f} s, not ok {r['not_ok']}"
                      + (f", counted {r['samples_counted']:.0f}" if on else "") + ")",
                      flush=True)
                if args.json:
                    print(json.dumps(r), flush=True)
    def median(key: str, on: bool) -> float:
        return statistics.median(r[key] for r in runs if r["metrics"] is on)

    ratio = median("per_s", True) / median("per_s", False)
    cpu = median("worker_cpu_ms_per_sample", True) / median("worker_cpu_ms_per_sample", False)
    print(f"median samples/s: metrics on {median('per_s', True):.1f}, off "
          f"{median('per_s', False):.1f}; ratio {ratio:.3f}")
    print(f"median worker CPU ms/sample: on {median('worker_cpu_ms_per_sample', True):.3f}, "
          f"off {median('worker_cpu_ms_per_sample', False):.3f}; ratio {cpu:.3f}")
    print(f"{'PASS' if ratio > 0.95 else 'FAIL'}  metrics cost < 5% of throughput")
    print(f"{'PASS' if cpu < 1.05 else 'FAIL'}  metrics cost < 5% of worker CPU per sample")


if __name__ == "__main__":
    main()
