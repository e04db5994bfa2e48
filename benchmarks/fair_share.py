"""Fair shares between jobs on one judge quota: three training jobs, one limit.

    python benchmarks/fair_share.py [--json] [--no-gate] [--both]

One mock judge allows 3000 rpm (50/s; one second's worth in its bucket), 64 in flight, latency
200 ms; the backend file says the same rpm; 2 `qrq worker` processes, one chunk task at once
each (chunks of 13 samples at 3000 rpm: what runs beside the queue is ~0.5 s of work). Three
jobs with weights 1, 1, 2 (`[jobs.<job>] weight`) submit `train` batches from three separate
processes, each keeping two batches of BATCH samples in flight:

    t = 0        job a starts alone               (alone: its share of the limit, 3..ALONE_END)
    t = B_AT     job b (weight 1) joins
    t = C_AT     job c (weight 2) joins late      (late join: when c first holds its share)
    t = VAL_AT   job a submits a `val` batch of VAL samples (its finish against everyone's
                 train work)
    t = END      every job cancels what is left

Shares are counted from each job's own outcomes (the moment each scored sample reached its
process, one judge call per sample), in 5 s windows from C_AT + 2 s while all three have
work; `use_of_limit` is every job's scored samples per second in those windows over 50/s.
`late_join_s`: from c's first submit until c's share over the trailing second first reaches
its weight's share minus 5 points. `--no-gate` runs the same with `[jobs] fair_shares =
false` (every chunk published at once, as before fair shares); `--both` runs the two in turn.
Uses $QRQ_BENCH_REDIS_URL (default database 9), flushed first. The machine may be shared:
figures are a run's, ratios within one run. Never exits non-zero on a miss.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BACKEND, REDIS_URL, QrqWorker, flush_redis, judge_config, write_config

import qreward_queue
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn

SERVER_RPM = 3000
LIMIT_PER_S = SERVER_RPM / 60
WEIGHTS = {"a": 1.0, "b": 1.0, "c": 2.0}
BATCH = 512
IN_FLIGHT = 2  # batches each job keeps submitted
B_AT, C_AT, VAL_AT, END = 8.0, 16.0, 38.0, 46.0
ALONE_START, ALONE_END = 3.0, 8.0
VAL = 100
WINDOW_S = 5.0
WORKERS = 2
CALLS = 16  # calls in flight per worker: 50/s x 0.2 s x 3 over 2 workers
TASKS = 1  # chunk tasks each worker runs at once: what runs beside the queue stays small


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def job_process(config: str, job: str, t0: float, start: float, end: float, val_at: float | None,
                out: mp.Queue) -> None:
    """One trainer: keeps IN_FLIGHT train batches submitted from `start` to `end`; reports
    the time of each scored sample (and of its val batch's, with `val_at`)."""
    app = qreward_queue.configure(config)
    times: list[float] = []
    val_times: list[float] = []
    val_span: list[float] = []
    time.sleep(max(0.0, t0 + start - time.time()))
    first_submit = time.time() - t0
    batches: list = []
    n = 0

    def record(into: list[float]):
        return lambda _i, outcome: into.append(time.time() - t0) if outcome.scored else None

    while time.time() < t0 + end:
        batches = [b for b in batches if not b.done()]
        while len(batches) < IN_FLIGHT:
            samples = [{"prompt": f"{job} {n} {i}", "response": str(i)} for i in range(BATCH)]
            n += 1
            batch = qreward_queue.submit_batch(samples, app=app, job=job, deadline_s=300)
            batch.on_outcome(record(times))
            batches.append(batch)
        if val_at is not None and not val_span and time.time() >= t0 + val_at:
            samples = [{"prompt": f"{job} val {i}", "response": str(i)} for i in range(VAL)]
            val_span.append(time.time() - t0)
            vb = qreward_queue.submit_batch(samples, app=app, job=job, priority="val",
                                            deadline_s=60)
            vb.on_outcome(record(val_times))
            vb.get()
            val_span.append(time.time() - t0)
        time.sleep(0.05)
    for batch in batches:
        batch.cancel()
    out.put({"job": job, "first_submit": first_submit, "times": times,
             "val_times": val_times, "val_span": val_span})


def run(gate: bool) -> dict:
    flush_redis()
    with tempfile.TemporaryDirectory(prefix="qrq-fair-") as tmp, spawn(MockJudgeSettings(
            rpm=SERVER_RPM, max_concurrent=64, latency_ms=200.0, latency_cv=0.5)) as mock:
        backend = judge_config(mock.url, rpm=SERVER_RPM, max_concurrent=64, calls=CALLS)
        backend["pool"]["concurrency"] = TASKS
        path = write_config(Path(tmp), {BACKEND: backend}, redis_url=REDIS_URL, route=BACKEND,
                            deadline_s=300)
        jobs = [f"[jobs.{j}]\nweight = {w}" for j, w in WEIGHTS.items()]
        path.write_text(path.read_text() + f"[jobs]\nfair_shares = {str(gate).lower()}\n"
                        + "\n".join(jobs) + "\n")
        app = qreward_queue.configure(str(path))
        workers = [QrqWorker(path, BACKEND, f"w{i + 1}", app) for i in range(WORKERS)]
        try:
            ctx = mp.get_context("spawn")
            out: mp.Queue = ctx.Queue()
            t0 = time.time() + 3.0  # the processes import and connect first
            starts = {"a": 0.0, "b": B_AT, "c": C_AT}
            procs = [ctx.Process(target=job_process, args=(
                str(path), j, t0, starts[j], END, VAL_AT if j == "a" else None, out))
                for j in WEIGHTS]
            for p in procs:
                p.start()
            mock.reset()
            got = {r["job"]: r for r in (out.get(timeout=END + 120) for _ in procs)}
            for p in procs:
                p.join(30)
        finally:
            for w in workers:
                w.stop()
    return figures(got, gate)


def _count(times: list[float], start: float, end: float) -> int:
    return sum(start <= t < end for t in times)


def figures(got: dict, gate: bool) -> dict:
    everyone = {j: got[j]["times"] + got[j]["val_times"] for j in got}
    first = {j: got[j]["first_submit"] for j in got}
    alone = _count(everyone["a"], ALONE_START, ALONE_END) / (ALONE_END - ALONE_START)
    windows = []
    start = C_AT + 2.0
    while start + WINDOW_S <= VAL_AT:
        counts = {j: _count(everyone[j], start, start + WINDOW_S) for j in everyone}
        total = sum(counts.values()) or 1
        windows.append({"from_s": start, "shares_pct": {j: round(100 * c / total, 1)
                                                        for j, c in counts.items()},
                        "use_of_limit": round(total / WINDOW_S / LIMIT_PER_S, 3)})
        start += WINDOW_S
    want = {j: 100 * w / sum(WEIGHTS.values()) for j, w in WEIGHTS.items()}
    worst = max((round(abs(w["shares_pct"][j] - want[j]), 1) for w in windows for j in want),
                default=None)
    late = None
    t = first["c"]
    while t < first["c"] + 20:
        t += 0.1
        c = _count(everyone["c"], t - 1.0, t)
        total = sum(_count(everyone[j], t - 1.0, t) for j in everyone)
        if total and 100 * c / total >= want["c"] - 5:
            late = round(t - first["c"], 2)
            break
    late_first = min((t for t in everyone["c"] if t >= first["c"]), default=None)
    val_span = got["a"]["val_span"]
    val = None
    if len(val_span) == 2:
        others = sum(_count(everyone[j], *val_span) for j in ("b", "c"))
        a_train = _count(got["a"]["times"], *val_span)
        vals = len(got["a"]["val_times"])
        val = {"samples": VAL, "wall_s": round(val_span[1] - val_span[0], 2),
               "ideal_s": round(VAL / LIMIT_PER_S, 2),
               "share_of_calls_while_running_pct": round(
                   100 * vals / ((vals + others + a_train) or 1), 1),
               "at_a_share_would_take_s": round(VAL / (LIMIT_PER_S * want["a"] / 100), 1)}
    return {"gate": gate, "alone_share_of_limit": round(alone / LIMIT_PER_S, 3),
            "windows": windows, "worst_share_miss_points": worst,
            "min_use_of_limit": min((w["use_of_limit"] for w in windows), default=None),
            "late_join_s": late,
            "late_first_outcome_s": None if late_first is None else round(late_first - first["c"],
                                                                          2),
            "val": val}


def show(result: dict) -> None:
    print(f"fair_shares = {str(result['gate']).lower()}: weights a 1, b 1, c 2 "
          f"(targets 25/25/50 %), judge {SERVER_RPM} rpm")
    print(f"  a alone ({ALONE_START:g}-{ALONE_END:g} s): "
          f"{result['alone_share_of_limit']:.1%} of the limit")
    for w in result["windows"]:
        s = w["shares_pct"]
        print(f"  {w['from_s']:5.1f}-{w['from_s'] + WINDOW_S:5.1f} s: a {s['a']:5.1f} %  "
              f"b {s['b']:5.1f} %  c {s['c']:5.1f} %   use of the limit {w['use_of_limit']:.1%}")
    print(f"  worst miss of a share: {result['worst_share_miss_points']} points; late job c: "
          f"first outcome after {result['late_first_outcome_s']} s, at its share (trailing "
          f"second) after {result['late_join_s']} s")
    if result["val"]:
        v = result["val"]
        print(f"  a's val batch ({v['samples']} samples): {v['wall_s']} s (the limit alone: "
              f"{v['ideal_s']} s; at a's train share: {v['at_a_share_would_take_s']} s); "
              f"{v['share_of_calls_while_running_pct']} % of the calls while it ran")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--no-gate", action="store_true", help="[jobs] fair_shares = false")
    parser.add_argument("--both", action="store_true", help="without the gate, then with it")
    args = parser.parse_args()
    modes = [False, True] if args.both else [not args.no_gate]
    results = []
    for gate in modes:
        log(f"run with fair_shares = {gate}")
        results.append(run(gate))
    if args.json:
        print(json.dumps(results if args.both else results[0], indent=2))
    else:
        for result in results:
            show(result)


if __name__ == "__main__":
    main()
