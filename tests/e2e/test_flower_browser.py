"""Flower as a person sees it: a real headless Chromium on the dashboard and the tasks page,
during a batch, with basic auth; the rendered text must show the pools' workers and the tasks,
and never a prompt or an API key. Flower's own /metrics is scraped too.

Set QRQ_SCREENSHOTS_DIR (e.g. docs) to keep the screenshots."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from support import (
    ROOT,
    free_port,
    function_backend,
    judge_backend,
    start_workers,
    wait_for,
    write_route_config,
)

import qreward_queue as qrq
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium package")
pytest.importorskip("flower")

AUTH = ("admin", "fl0wer-pw")
API_KEY = "sk-test-flower-must-never-show-9f3a"
PROMPT = "secret-prompt-text-7c41"


def chromium(url: str, *args: str) -> str:
    """Run headless Chromium on `url` (JavaScript given 8 s of virtual time); its stdout."""
    cmd = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--window-size=1400,900", "--virtual-time-budget=8000", *args, url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_flower_in_a_browser_during_a_batch(tmp_path, redis_url, stack):
    mock = stack.enter_context(spawn(MockJudgeSettings(latency_ms=3000, latency_cv=0.1)))
    config_path = write_route_config(
        tmp_path,
        {"judge-a": judge_backend(mock.url, rpm=600, max_concurrent=4, concurrency=4,
                                  api_key_env="QRQ_TEST_FLOWER_KEY"),
         "exact": function_backend("qreward_queue.rewards.basic:exact_match", chunk_size=8)},
        redis_url=redis_url,
        routes={"judged": {"backends": ["judge-a"]}, "math": {"backends": ["exact"]}},
    )
    env = {**os.environ, "QRQ_CONFIG": str(config_path), "FLOWER_BASIC_AUTH": ":".join(AUTH)}
    env.pop("QRQ_REDIS_URL", None)
    workers = start_workers(config_path, [
        ("judge-a", "judge-a@pool1", {"QRQ_TEST_FLOWER_KEY": API_KEY}),
        ("exact", "exact@pool1"),
    ])
    for w in workers:
        stack.callback(w.stop)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "flower.log").open("w")
    flower = subprocess.Popen(
        [str(Path(sys.executable).parent / "celery"), "--app", "qreward_queue.ops.celery_app",
         "flower", "--address=127.0.0.1", f"--port={port}"],
        env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    stack.callback(flower.wait, 20)
    stack.callback(flower.terminate)

    def up() -> bool:
        try:
            return requests.get(f"{url}/healthcheck", timeout=1).ok
        except requests.RequestException:
            return False

    wait_for(up, 60, "Flower to answer")
    # Without credentials every page and the API are refused; /metrics stays open (Flower
    # serves it to Prometheus without auth), so it is checked for secrets below
    for page in ("/", "/tasks", "/workers", "/api/workers", "/api/tasks"):
        assert requests.get(url + page, timeout=10).status_code == 401, page
    # Given a batch running on both pools (the judge's: 3 s a call, 4 at a time, for minutes)
    app = qrq.configure(qrq.load_config(config_path))
    judged = qrq.submit_batch([{"prompt": f"{PROMPT} {i}", "response": f"r{i}"}
                               for i in range(200)], route="judged", app=app)
    math_batch = qrq.submit_batch([{"prompt": f"{PROMPT} q{i}", "response": f"= {i}",
                                    "reference": str(i)} for i in range(64)], route="math",
                                  app=app)

    def judge_task() -> str | None:  # the math pool's tasks may be all Flower has seen so far
        tasks = requests.get(f"{url}/api/tasks", auth=AUTH, timeout=10).json()
        return next((i for i, t in tasks.items() if "judge-a" in (t.get("args") or "")), None)

    task_id = wait_for(judge_task, 60, "Flower to see a task of the judge's pool")
    # When a browser opens the dashboard and the tasks page
    authed = url.replace("://", f"://{AUTH[0]}:{AUTH[1]}@")
    shots = {}
    texts = {}
    for name, page in (("dashboard", "/"), ("tasks", "/tasks"), ("task", f"/task/{task_id}")):
        shots[name] = tmp_path / f"flower-{name}.png"
        chromium(authed + page, f"--screenshot={shots[name]}")
        texts[name] = chromium(authed + page, "--dump-dom")
        if os.environ.get("QRQ_SCREENSHOTS_DIR"):
            shutil.copy(shots[name], ROOT / os.environ["QRQ_SCREENSHOTS_DIR"])
            (tmp_path / f"{name}.html").write_text(texts[name])
        assert shots[name].stat().st_size > 10_000  # a rendered page, not a blank one
    # Then the dashboard lists each pool's worker, the tasks page the scoring tasks
    assert "judge-a@pool1" in texts["dashboard"] and "exact@pool1" in texts["dashboard"]
    assert "qrq.score_chunk" in texts["tasks"] and "judge-a@pool1" in texts["tasks"]
    # a task's own page shows its arguments as qrq writes them for Flower: no sample content
    assert re.search(r"\('judge-a', &lt;\d+ samples&gt;\)", texts["task"])
    # And no page, no API answer and no metric carries a prompt or the key
    api = requests.get(f"{url}/api/tasks", auth=AUTH, timeout=10).text
    metrics = requests.get(f"{url}/metrics", timeout=10).text
    assert "flower_events_total" in metrics and "judge-a@pool1" in metrics
    for text in (*texts.values(), api, metrics):
        assert PROMPT not in text and API_KEY not in text and "QRQ_TEST_FLOWER_KEY" not in text
    assert {o.status for o in math_batch.outcomes()} == {"ok"}
    assert judged.completed < len(judged)  # the rest is dropped with the workers
