"""The examples run as a newcomer would run them."""

from __future__ import annotations

import ast
import subprocess
import sys

from support import ROOT


def test_batch_reward_fn_example_scores_every_sample():
    out = subprocess.run([sys.executable, "examples/batch_reward_fn.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [ast.literal_eval(line) for line in out.stdout.splitlines()]
    assert len(rows) == 4
    assert all(r["qrq_status"] == "ok" and r["qrq_backend"] == "judge" for r in rows)
    assert all(0.0 <= r["score"] <= 1.0 for r in rows)
