"""Judge calls bought twice per fault: a worker kill, a Redis restart without persistence and a
60 s Redis outage, each on a batch of 2,000 samples (tests/faults.py runs them; the mock
judge's request counter is the truth). Goal: <= 1% duplicates (20 calls), 0 samples lost.

    .venv/bin/python benchmarks/duplicates.py [--faults worker_kill,redis_restart] [--json]

To see the "before", run the same two files on an older checkout (they use only the public
API and the judge's counter).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from faults import FAULTS, SAMPLES, run_fault  # tests/faults.py, on sys.path above

GOAL = SAMPLES // 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--json", action="store_true", help="One JSON line per fault.")
    args = parser.parse_args()
    print(f"{'fault':<14} {'calls':>6} {'duplicates':>10} {'lost':>5} {'resent':>6} "
          f"{'wall s':>7}  goal: duplicates <= {GOAL}, lost 0")
    for fault in args.faults.split(","):
        with tempfile.TemporaryDirectory() as directory:
            figures = run_fault(fault, Path(directory))
        if args.json:
            print(json.dumps(figures))
        else:
            ok = figures["duplicates"] <= GOAL and figures["lost"] == 0
            print(f"{fault:<14} {figures['judge_calls']:>6} {figures['duplicates']:>10} "
                  f"{figures['lost']:>5} {figures['resubmitted_tasks']:>6} "
                  f"{figures['wall_s']:>7}  {'met' if ok else 'MISSED'}", flush=True)


if __name__ == "__main__":
    main()
