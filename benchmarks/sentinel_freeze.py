"""A frozen Sentinel primary: seconds from the sentinels' promotion of the replica to the first
sample scored through the new primary (tests/sentinel_freeze.py runs the scenario: a batch of
2,000 samples on two real workers, the primary SIGSTOPped a third of the way and thawed only
`--hold` seconds after the promotion, so a late recovery cannot come from the thaw).
Goal: <= 5 s, 0 lost, nobody served by the thawed (demoted) old primary.

    .venv/bin/python benchmarks/sentinel_freeze.py [--hold 90] [--baseline CHECKOUT] [--json]

`--baseline`: the same scenario first on a copy of another checkout (its package, its workers;
this file and the two scenario files copied in), and the ratio of the two figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from sentinel_freeze import run_freeze  # tests/sentinel_freeze.py, on sys.path above

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ("benchmarks/sentinel_freeze.py", "tests/sentinel_freeze.py",
            "tests/sentinel_cluster.py")

GOAL_S = 5.0


def measure(hold_s: float) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        figures = run_freeze(Path(directory), hold_s=hold_s, thaw_early=False)
    figures.pop("worker_logs")
    figures["lost"] = figures["samples"] - figures["statuses"].get("ok", 0)
    return figures


def measure_elsewhere(checkout: str, hold_s: float) -> dict:
    """`measure` on a copy of `checkout` with this scenario's files: its process and its
    workers import that copy's qreward_queue."""
    with tempfile.TemporaryDirectory() as directory:
        copy = Path(directory) / "checkout"
        shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(".git", ".venv"))
        for name in SCENARIO:
            shutil.copy(ROOT / name, copy / name)
        out = subprocess.run(
            [sys.executable, str(copy / SCENARIO[0]), "--hold", str(hold_s), "--json"],
            env={**os.environ, "PYTHONPATH": str(copy)}, cwd=copy, capture_output=True,
            text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def row(name: str, f: dict) -> str:
    first = f["first_sample_after_promotion_s"]
    shown = f"> {f['held_s'] - f['promotion_s']:.0f}" if first is None else f"{first:.1f}"
    return (f"{name:<10} {f['promotion_s']:>11.1f} {shown:>13} {f['lost']:>5} "
            f"{f['duplicates']:>10} {len(f['old_primary_served']):>13}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold", type=float, default=90.0,
                        help="Seconds from the promotion to the thaw (default 90).")
    parser.add_argument("--baseline", help="A checkout whose qreward_queue to measure first.")
    parser.add_argument("--json", action="store_true", help="One JSON line per run.")
    args = parser.parse_args()
    runs = {}
    if args.baseline:
        runs["baseline"] = measure_elsewhere(args.baseline, args.hold)
    runs["this"] = measure(args.hold)
    if args.json:
        for name, figures in runs.items():
            print(json.dumps({"code": name, **figures}))
        return
    print("machine shared with other work: compare the rows, not the absolute seconds")
    print(f"{'code':<10} {'promotion s':>11} {'1st sample s':>13} {'lost':>5} "
          f"{'duplicates':>10} {'old served':>13}   (goal: 1st sample <= {GOAL_S:g} s)")
    for name, figures in runs.items():
        print(row(name, figures))
    base, this = (runs.get("baseline", {}).get("first_sample_after_promotion_s"),
                  runs["this"]["first_sample_after_promotion_s"])
    if args.baseline and this:
        print(f"ratio baseline / this: {(base or args.hold) / this:.0f}x"
              + ("" if base else " (at least: the baseline had none before the thaw)"))


if __name__ == "__main__":
    main()
