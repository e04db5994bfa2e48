"""Shared pieces of the benchmarks: config files, real `qrq worker` subprocesses, CPU from /proc,
per-run figures, the table and the JSON lines.

Every benchmark talks to the real Redis at $QRQ_BENCH_REDIS_URL (default 127.0.0.1:6379,
database 9; routes.py: 10), flushed at the start of each scenario, and to mock judges run as
subprocesses (`qreward_queue.testing.mock_judge.spawn`).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from support import PrivateRedis, write_config  # noqa: E402, F401  (tests/support.py, put on sys.path above)

REDIS_URL = os.environ.get("QRQ_BENCH_REDIS_URL", "redis://127.0.0.1:6379/9")
BACKEND = "judge"
CLK_TCK = os.sysconf("SC_CLK_TCK")

__all__ = [
    "BACKEND",
    "REDIS_URL",
    "QrqWorker",
    "Run",
    "SampleResult",
    "flush_redis",
    "judge_config",
    "percentile",
    "print_table",
    "process_tree_cpu_s",
    "write_config",
]


def flush_redis(url: str = REDIS_URL) -> None:
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()


def judge_config(
    url: str, *, rpm: float, max_concurrent: int, calls: int | None, timeout_s: float = 30.0
) -> dict:
    """The backend file of a judge at `url` (a mock judge's base URL) with these limits and
    `calls` in flight per worker process (2 chunk tasks at once); `calls=None`: untuned, as
    the docs advise (no [pool] table: the pool sizes itself)."""
    pool = {} if calls is None else {"pool": {"type": "threads", "concurrency": 2, "calls": calls}}
    return {
        "backend": {"kind": "judge", "url": url + "/v1", "model": "mock", "timeout_s": timeout_s},
        "limits": {"rpm": rpm, "max_concurrent": max_concurrent},
        **pool,
        "retry": {"attempts": 3, "backoff_base_s": 0.1, "backoff_cap_s": 1.0},
    }


class QrqWorker:
    """A real `qrq worker` subprocess at log level WARNING (no log line per task), ready once it
    answers a Celery ping; `cpu_s()` is the CPU time of it and its children, from /proc."""

    def __init__(self, config: Path, backend: str, name: str, app, timeout_s: float = 30.0):
        self.hostname = f"{name}@bench"
        self.log = config.parent / f"worker-{name}.log"
        env = {**os.environ, "QRQ_CONFIG": str(config)}
        env.pop("QRQ_REDIS_URL", None)
        cmd = [sys.executable, "-m", "qreward_queue.cli", "worker",
               str(config.parent / "workers" / f"{backend}.toml"),
               "--loglevel", "WARNING", "-n", self.hostname]
        with self.log.open("w") as fh:
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                         cwd=ROOT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not app.control.ping(destination=[self.hostname], timeout=0.3):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"worker did not start:\n{self.log.read_text()[-3000:]}")

    def cpu_s(self) -> float:
        return process_tree_cpu_s(self.proc.pid)

    def terminate(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self) -> None:
        self.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _proc_stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds of the process incl. its reaped children) or None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
    ppid = int(fields[1])
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return ppid, (utime + stime + cutime + cstime) / CLK_TCK


def process_tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) of `root` and all its live descendants, plus the children it
    has already reaped."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _proc_stat(int(entry))
            if stat is not None:
                parents[int(entry)], cpu[int(entry)] = stat
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == pid and p not in tree]
        tree.update(kids)
        frontier.extend(kids)
    return sum(cpu.get(p, 0.0) for p in tree)


@dataclass
class SampleResult:
    """What a client handed back for one sample: its score, whether it really came from the
    judge (`ok`), whether the client flagged it as a fallback (`flagged`), and its latency."""

    score: float
    ok: bool
    latency_ms: float
    flagged: bool = False


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]


@dataclass
class Run:
    """One (scenario, client) run: the figures of the table and of the JSON line."""

    scenario: str
    client: str
    n: int
    wall_s: float
    limit_per_s: float
    server_429: int
    server_requests: int
    not_ok: int
    wrong: int
    p50_ms: float | None
    p99_ms: float | None
    worker_cpu_ms_per_request: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def per_s(self) -> float:
        return self.n / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def fraction_of_limit(self) -> float:
        return self.per_s / self.limit_per_s

    @property
    def ok_per_s(self) -> float:
        """Samples with a real judge score per second (a silent 0.0 is not one)."""
        return (self.n - self.not_ok) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def pct_429(self) -> float:
        return 100.0 * self.server_429 / self.server_requests if self.server_requests else 0.0

    def to_json(self) -> str:
        data = asdict(self)
        extra = data.pop("extra")
        data.pop("limit_per_s")
        data |= {
            "per_s": round(self.per_s, 2),
            "fraction_of_limit": round(self.fraction_of_limit, 4),
            "ok_per_s": round(self.ok_per_s, 2),
            "ok_fraction_of_limit": round(self.ok_per_s / self.limit_per_s, 4),
            "limit_per_s": round(self.limit_per_s, 3),
            "server_429_pct": round(self.pct_429, 2),
            "wall_s": round(self.wall_s, 3),
        }
        for key in ("p50_ms", "p99_ms", "worker_cpu_ms_per_request"):
            if data[key] is not None:
                data[key] = round(data[key], 2)
        return json.dumps({**data, **extra})


def score_results(results: list[SampleResult], expected: list[float]) -> tuple[int, int]:
    """(not_ok, wrong): samples without a real judge score, and scores handed over as real that
    disagree with the judge's rule (a silent fallback 0.0 counts as wrong; a flagged one not)."""
    not_ok = sum(not r.ok for r in results)
    wrong = sum(
        not r.flagged and abs(r.score - want) > 1e-9
        for r, want in zip(results, expected, strict=True)
    )
    return not_ok, wrong


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(title: str, runs: list[Run], notes: list[str]) -> None:
    print(f"\n== {title}")
    header = (f"{'client':<22}{'n':>6}{'wall_s':>8}{'per_s':>8}{'of_limit':>9}{'ok/s':>7}"
              f"{'requests':>9}{'429':>7}{'429%':>7}{'not_ok':>7}{'wrong':>6}{'p50_ms':>8}"
              f"{'p99_ms':>8}{'cpu_ms/req':>11}")
    print(header)
    print("-" * len(header))
    for r in runs:
        print(f"{r.client:<22}{r.n:>6}{r.wall_s:>8.2f}{r.per_s:>8.1f}{r.fraction_of_limit:>9.1%}"
              f"{r.ok_per_s:>7.1f}{r.server_requests:>9}{r.server_429:>7}{r.pct_429:>6.1f}%"
              f"{r.not_ok:>7}{r.wrong:>6}{_fmt(r.p50_ms, '.0f'):>8}{_fmt(r.p99_ms, '.0f'):>8}"
              f"{_fmt(r.worker_cpu_ms_per_request, '.2f'):>11}")
    for r in runs:
        for why in r.extra.get("not_ok_reasons", []):
            print(f"  {r.client} not ok: {why}")
    for note in notes:
        print(f"  note: {note}")


# --- Added for benchmarks/routes.py (several backends, a private Redis) ------------------------


def start_qrq_workers(config: Path, specs: list[tuple[str, str]], app,
                      timeout_s: float = 60.0) -> list[QrqWorker]:
    """One `QrqWorker(config, backend, name, app)` per (backend, name), started at the same time
    (each takes a few seconds to answer a ping); if one fails, the others are stopped."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, len(specs))) as pool:
        futures = [pool.submit(QrqWorker, config, backend, name, app, timeout_s)
                   for backend, name in specs]
    workers, errors = [], []
    for future in futures:
        try:
            workers.append(future.result())
        except Exception as exc:  # stop the ones that did start before raising
            errors.append(exc)
    if errors:
        for w in workers:
            w.stop()
        raise errors[0]
    return workers


def run_scenarios(scenarios: dict, args, targets, before_table=None, after_table=None) -> None:
    """Run the chosen scenarios, print each table (and JSON lines with --json), then one
    PASS/FAIL line per target and the total wall time. A scenario that fails to run is
    reported and the others still run."""
    started = time.perf_counter()
    all_runs: list[Run] = []
    for name in scenarios if args.scenario == "all" else [args.scenario]:
        title, fn = scenarios[name]
        try:
            runs, notes = fn(args)
        except Exception as exc:  # report it and go on with the other scenarios
            print(f"\n== {title}\n  {name} FAILED TO RUN: {type(exc).__name__}: {exc}")
            continue
        if before_table:
            before_table(name, runs)
        print_table(title, runs, notes)
        if after_table:
            after_table(name, runs)
        if args.json:
            for r in runs:
                print(r.to_json())
        sys.stdout.flush()
        all_runs += runs
    print("\n== targets")
    for what, ok, figure in targets(all_runs):
        print(f"{'PASS' if ok else 'FAIL'}  {what}: {figure}")
    print(f"total benchmark wall time: {time.perf_counter() - started:.0f} s")
