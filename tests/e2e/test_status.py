"""`qrq status` shows each backend's queue, buckets, leases, adaptive concurrency and 429s."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support import ROOT, judge_backend, reply, write_config

import qreward_queue as qrq
from qreward_queue.broker.app import QrqCelery
from qreward_queue.ops.status import backend_rows
from qreward_queue.planning.capacity import QueuedSamples


def test_status_reports_what_the_limiter_and_queue_hold(tmp_path, redis_url):
    config_path = write_config(
        tmp_path, {"ja": judge_backend("http://127.0.0.1:9", rpm=600, max_concurrent=8)},
        redis_url=redis_url, route="ja",
    )
    app = QrqCelery(qrq.load_config(config_path))
    limiter = app.flow.limiter("ja")
    with limiter.acquire(tokens=10) as grant:
        (row,) = backend_rows(app)
        assert row["leases_in_use"] == 1
        reply(grant, 429, {"retry-after": "1"})
    # Given three queued tasks of 3 samples each (as a publisher counts them) and a 429, when
    # the status is read
    app.send_task("qrq.score_chunk", kwargs={}, queue="qrq.ja", priority=6)
    app.send_task("qrq.score_chunk", kwargs={}, queue="qrq.ja", priority=0)
    app.send_task("qrq.score_chunk", kwargs={}, queue="qrq.ja", priority=9)
    QueuedSamples(app.store).add({"qrq.ja": 9})
    (row,) = backend_rows(app)
    assert row["queued"] == 3
    assert row["recent_429s"] == 1
    assert row["leases_in_use"] == 0
    assert row["adaptive_limit"] == 4  # halved from 8 by the 429
    assert row["limits"]["rpm"]["capacity"] == 10
    # Then the command prints the same figures in one line per backend
    env = {**os.environ, "QRQ_CONFIG": str(config_path)}
    env.pop("QRQ_REDIS_URL", None)
    out = subprocess.run([sys.executable, "-m", "qreward_queue.cli", "status"], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("qrq: distributed mode")
    (ja,) = [line for line in lines if line.startswith("ja ")]
    fields = ja.split()
    # samples queued, scored per second (none: no worker), live workers, then tasks by
    # val/train/bulk
    assert fields[1:6] == ["judge", "9", "0.0", "0", "1/1/1"]
    assert fields[6] == "600/600"  # rpm enforced now / configured
    assert fields[9:11] == ["4", "1"]  # adaptive limit, 429s in the last minute
    # breaker; ETA: 9 samples at the rpm limit, 10/s
    assert fields[-2:] == ["closed", "0.9"]
    # And --json carries the same row
    out = subprocess.run([sys.executable, "-m", "qreward_queue.cli", "status", "--json"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    (row,) = json.loads(out.stdout)["backends"]
    assert row["queued_by_priority"] == {"val": 1, "train": 1, "bulk": 1}
    assert (row["adaptive_limit"], row["recent_429s"], row["breaker"]) == (4, 1, "closed")
    assert row["limit_samples_per_s"] == 10 and row["eta_s"] == pytest.approx(0.9)
    assert (row["queued_samples"], row["samples_per_s"]) == (9, 0.0)


def test_status_in_embedded_mode_says_there_is_no_shared_state(tmp_path):
    config_path = write_config(tmp_path, {"ja": judge_backend("http://127.0.0.1:9")},
                               route="ja")
    env = {**os.environ, "QRQ_CONFIG": str(config_path)}
    env.pop("QRQ_REDIS_URL", None)
    out = subprocess.run([sys.executable, "-m", "qreward_queue.cli", "status"], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert out.stdout.splitlines()[0].startswith("qrq: embedded mode")
    assert "no shared state" in out.stdout
