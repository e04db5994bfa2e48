"""Innocent code samples next to a hostile neighbour: their scores and time per sample.

A hostile process (another worker, as far as the machine can tell) scores one sample after
another through `code_reward` whose correct program hogs the machine in each case while it
answers; meanwhile this process scores 8 innocent samples (3 cases each, ~30 ms of CPU).
Each class of neighbour gets its own run; `none` is the baseline. Every innocent sample
should score 1.0 whatever runs beside it.

    python benchmarks/sandbox_neighbours.py              # all classes
    python benchmarks/sandbox_neighbours.py --json --classes none setsid_spinners
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qreward_queue.rewards import sandbox
from qreward_queue.rewards.code import code_reward

SPIN = """
import os, time
for _ in range(40):
    if os.fork() == 0:
        {detach}
        while True:
            pass
time.sleep(0.8)
print(int(input()) * 2)
"""
NEIGHBOURS = {
    "none": None,
    "spinners": SPIN.format(detach="pass"),
    "setsid_spinners": SPIN.format(detach="os.setsid() if hasattr(os, 'setsid') else None"),
    "thread_spinners": (
        "import threading, time\nfor _ in range(40):\n"
        "    threading.Thread(target=lambda: [0 for _ in iter(int, 1)], daemon=True).start()\n"
        "time.sleep(0.8)\nprint(int(input()) * 2)"
    ),
}
HOSTILE = """
import sys
from qreward_queue.rewards.code import code_reward
tests = [{{"input": str(k), "output": str(2 * k)}} for k in range(40)]
print("started", flush=True)
while True:
    code_reward({{"prompt": "", "response": {program!r}, "extra": {{"tests": tests}}}},
                time_s=60, case_s=2)
"""
INNOCENT = "n = int(input())\nprint(sum(k * k for k in range(n)))"


def innocent_samples() -> list[dict]:
    out = []
    for i in range(8):
        ns = [300_000 + 1000 * i + k for k in range(3)]
        tests = [{"input": str(n), "output": str(sum(k * k for k in range(n)))} for n in ns]
        out.append({"prompt": "", "response": INNOCENT, "extra": {"tests": tests}})
    return out


def with_neighbour(name: str) -> dict:
    program = NEIGHBOURS[name]
    hostile = None
    if program is not None:
        hostile = subprocess.Popen(
            [sys.executable, "-c", HOSTILE.format(program=program)],
            stdout=subprocess.PIPE, text=True,
        )
        assert hostile.stdout is not None and hostile.stdout.readline().strip() == "started"
        _wait_for_busy(hostile.pid)
    try:
        scores, seconds = [], []
        for sample in innocent_samples():
            started = time.perf_counter()
            scores.append(float(code_reward(sample, case_s=1, time_s=10)))
            seconds.append(time.perf_counter() - started)
    finally:
        if hostile is not None:
            _kill_tree(hostile)
    return {
        "neighbour": name,
        "mechanism": sandbox.pick_mechanism(),
        "innocent_passed": f"{sum(s == 1.0 for s in scores)}/{len(scores)}",
        "innocent_mean_score": round(sum(scores) / len(scores), 3),
        "s_per_sample": round(sum(seconds) / len(seconds), 3),
        "max_s": round(max(seconds), 3),
    }


def _kill_tree(proc: subprocess.Popen) -> None:
    tree = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _wait_for_busy(pid: int) -> None:
    """Until the neighbour's first case runs (its sandbox has started its program)."""
    for _ in range(600):
        if len(psutil.Process(pid).children(recursive=True)) >= 4:
            return
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", nargs="*", default=list(NEIGHBOURS), choices=NEIGHBOURS)
    parser.add_argument("--json", action="store_true", help="also one JSON line per run")
    args = parser.parse_args()
    print(f"{'neighbour':18} {'innocent':>8} {'mean':>5} {'s/sample':>8} {'max_s':>6}")
    for name in args.classes:
        run = with_neighbour(name)
        print(f"{name:18} {run['innocent_passed']:>8} {run['innocent_mean_score']:5.2f} "
              f"{run['s_per_sample']:8.3f} {run['max_s']:6.2f}", flush=True)
        if args.json:
            print(json.dumps(run), flush=True)


if __name__ == "__main__":
    main()
