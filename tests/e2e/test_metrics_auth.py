"""`qrq exporter` (and the workers' metrics port, the same server) listen on 127.0.0.1 unless
told otherwise, warn when told to listen widely without a token, and with QRQ_METRICS_TOKEN
answer only scrapes that carry it."""

from __future__ import annotations

import os
import subprocess
import sys

import requests
from support import ROOT, free_port, wait_for


def start_exporter(tmp_path, redis_url, env, *args):
    port = free_port()
    log = tmp_path / f"exporter-{port}.log"
    with log.open("w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "qreward_queue.cli", "exporter", "--port", str(port), *args],
            stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
            env={**os.environ, "QRQ_REDIS_URL": redis_url, "QRQ_CONFIG": str(ROOT / "qrq.toml"),
                 **env})
    wait_for(lambda: proc.poll() is not None or "exporter on" in log.read_text(), 30,
             "the exporter")
    return proc, log, f"http://127.0.0.1:{port}/metrics"


def test_a_token_guards_the_exporter_and_loopback_is_the_default(tmp_path, redis_url):
    proc, log, url = start_exporter(tmp_path, redis_url, {"QRQ_METRICS_TOKEN": "t0ken-abc"})
    try:
        assert "exporter on 127.0.0.1:" in log.read_text()
        assert requests.get(url, timeout=5).status_code == 401
        assert requests.get(url, headers={"Authorization": "Bearer wrong"},
                            timeout=5).status_code == 401
        page = requests.get(url, headers={"Authorization": "Bearer t0ken-abc"}, timeout=5)
        assert page.ok and "qrq_workers_alive" in page.text
        assert "t0ken-abc" not in log.read_text()
    finally:
        proc.terminate()
        proc.wait(10)


def test_listening_widely_without_a_token_is_warned_about(tmp_path, redis_url):
    proc, log, url = start_exporter(tmp_path, redis_url, {}, "--host", "0.0.0.0")
    try:
        assert "warning: the exporter listens on 0.0.0.0 without authentication" in \
            log.read_text()
        assert requests.get(url, timeout=5).ok
    finally:
        proc.terminate()
        proc.wait(10)
