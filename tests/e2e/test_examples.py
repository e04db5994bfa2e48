"""The examples run as a newcomer would run them: one per trainer, on the mock judge, with
QRQ_REDIS_URL still exported from README's "Running workers" (here a closed port): an example
says it runs embedded and does so, instead of waiting for a worker that will never come."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
from support import ROOT, free_port


@functools.cache  # each example runs once per session; several tests read its output
def run_example(name: str) -> list[dict]:
    env = {**os.environ, "QRQ_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    out = subprocess.run([sys.executable, f"examples/{name}.py"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert f"{name}.py: runs embedded with its own mock judge (QRQ_REDIS_URL is ignored here)" \
        in out.stderr.splitlines()
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.mark.parametrize("name, rows, score_key, status_key", [
    ("verl_reward", 4, "score", "qrq_status"),
    ("trl_reward", 4, "score", "qrq_status"),
    ("slime_rm", 4, "score", "qrq_status"),
    ("areal_workflow", 3, "score", None),
])
def test_each_trainer_example_scores_every_sample(name, rows, score_key, status_key):
    results = run_example(name)
    assert len(results) == rows
    assert all(0.0 <= r[score_key] <= 1.0 for r in results)
    if status_key:
        assert all(r[status_key] == "ok" for r in results)


def test_the_same_sample_gets_the_same_score_through_every_adapter():
    # "What is 2+2?" answered "4" with reference "4", as verl, TRL, slime and AReaL hand it over
    firsts = {run_example(name)[0]["score"]
              for name in ("verl_reward", "trl_reward", "slime_rm", "areal_workflow")}
    assert len(firsts) == 1


def test_openrlhf_example_gets_numeric_rewards_from_the_gateway():
    replies = run_example("openrlhf_gateway")
    assert len(replies) == 4
    for reply in replies:
        assert reply["rewards"] == reply["scores"] and 0.0 <= reply["rewards"][0] <= 1.0
        assert reply["extra_logs"] == {"qrq_ok": [1.0]}
