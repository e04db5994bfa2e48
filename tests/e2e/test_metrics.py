"""Prometheus metrics: real `qrq worker` processes scraped during a batch, the exporter's view
of Redis, and counters that add up to the batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import requests
from support import ROOT, free_port, function_backend, judge_backend, start_workers, wait_for
from support import write_route_config as write_config

import qreward_queue as qrq
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn

parser = pytest.importorskip("prometheus_client.parser")
URL_UNUSED = "http://127.0.0.1:9"  # never called


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a /metrics page."""
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in parser.text_string_to_metric_families(text)
        for s in family.samples
    }


def total(page: dict, name: str, **labels) -> float:
    """Sum of `name` over the samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lab), v in page.items() if n == name and want <= set(lab))


def try_scrape(port: int) -> dict | None:
    try:
        return scrape(port)
    except requests.RequestException:
        return None


def test_worker_counters_add_up_to_the_batch(tmp_path, redis_url, stack):
    mock = stack.enter_context(spawn(MockJudgeSettings(latency_ms=30, latency_cv=0.2)))
    config_path = write_config(
        tmp_path,
        {"ja": judge_backend(mock.url, rpm=1200, max_concurrent=8, concurrency=8),
         "fx": function_backend("qreward_queue.rewards.basic:exact_match", chunk_size=8,
                                concurrency=2)},
        redis_url=redis_url,
        routes={"judged": {"backends": ["ja"], "cache": True}, "exact": {"backends": ["fx"]}},
    )
    # every chunk on its queue at submit (fair shares would hold back all but ~1 s of work)
    config_path.write_text(config_path.read_text() + "[jobs]\nfair_shares = false\n")
    app = qrq.configure(qrq.load_config(config_path))
    judge_port, fx_port, exporter_port = free_port(), free_port(), free_port()
    env = {**os.environ, "QRQ_CONFIG": str(config_path)}
    env.pop("QRQ_REDIS_URL", None)
    exporter = subprocess.Popen(
        [sys.executable, "-m", "qreward_queue.cli", "exporter", "--port", str(exporter_port),
         "--host", "127.0.0.1"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT)
    stack.callback(exporter.wait, 10)
    stack.callback(exporter.terminate)
    secret = "do-not-leak-this-prompt"
    judged = [{"prompt": f"{secret} {i}", "response": f"answer {i}"} for i in range(120)]
    exact = [{"prompt": f"{secret} q{i}", "response": f"= {i % 3}", "reference": "1"}
             for i in range(100)]
    # Given two batches queued before any worker runs
    batch = qrq.submit_batch(judged, route="judged", app=app)
    exact_batch = qrq.submit_batch(exact, route="exact", priority="val", app=app)
    # Then the exporter shows them queued, by backend and priority
    page = wait_for(lambda: try_scrape(exporter_port), 30, "the exporter")
    # 120 samples in chunks of 5 (0.25 s of the rpm), 100 in chunks of 8
    assert total(page, "qrq_queue_depth", backend="ja", priority="train") == 24
    assert total(page, "qrq_queue_depth", backend="fx", priority="val") == 13  # 100 / 8 per task
    assert total(page, "qrq_max_concurrent", backend="ja") == 8
    assert total(page, "qrq_limit_requests_per_second", backend="ja") == 20  # base units
    assert total(page, "qrq_rate_limit_per_minute", backend="ja", limit="rpm") == 1200  # alias
    assert total(page, "qrq_breaker_state", backend="ja") == 0
    # When a threads worker and a prefork worker serve them with metrics on
    workers = start_workers(config_path, [
        ("ja", "ja@metrics", {"QRQ_METRICS_PORT": str(judge_port)}),
        ("fx", "fx@metrics", {"QRQ_METRICS_PORT": str(fx_port)}),
    ])
    for w in workers:
        stack.callback(w.stop)
    # Then the judge worker's counters move while the batch runs
    during = wait_for(lambda: total(scrape(judge_port), "qrq_samples_total"), 30,
                      "samples counted during the batch")
    assert 0 < during <= 120
    outcomes = batch.outcomes()
    assert {o.status for o in outcomes} == {"ok"}
    assert {o.status for o in exact_batch.outcomes()} == {"ok"}
    # And after it, every counter adds up to the batch (Celery stores a result before it
    # signals success, where samples are counted: the last ones may lag the client a little)
    page = wait_for(lambda: (p := scrape(judge_port)) and total(p, "qrq_samples_total") == 120
                    and p, 10, "the last samples to be counted")
    assert total(page, "qrq_samples_total", backend="ja", route="judged", status="ok") == 120
    assert total(page, "qrq_backend_requests_total", backend="ja", code="200") == 120
    assert total(page, "qrq_backend_latency_seconds_count", backend="ja") == 120
    assert total(page, "qrq_limiter_wait_seconds_count", backend="ja") == 120
    assert 0.03 * 120 * 0.5 < total(page, "qrq_backend_latency_seconds_sum", backend="ja") < 120
    assert total(page, "qrq_retries_total") == 0
    # qrq plan can take the measured latency from the page: its mean is sum / count
    plan = subprocess.run(
        [sys.executable, "-m", "qreward_queue.cli", "plan", "--route", "judged", "-n", "120",
         "--metrics-url", f"http://127.0.0.1:{judge_port}/metrics", "--json"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    (row,) = json.loads(plan.stdout)["backends"]
    mean_s = (total(page, "qrq_backend_latency_seconds_sum", backend="ja")
              / total(page, "qrq_backend_latency_seconds_count", backend="ja"))
    assert row["rates"]["concurrency"] == pytest.approx(8 / mean_s)
    # the prefork pool's two children add up through the multi-process directory
    fx_page = wait_for(lambda: (p := scrape(fx_port)) and total(p, "qrq_samples_total") == 100
                       and p, 10, "the prefork pool's samples to be counted")
    assert total(fx_page, "qrq_samples_total", backend="fx", route="exact", status="ok") == 100
    assert total(fx_page, "qrq_backend_requests_total", backend="fx", code="ok") == 13
    # And a second pass of the cached route counts 120 lookups and 120 hits in Redis
    assert qrq.submit_batch(judged, route="judged", app=app).get() == [o.score for o in outcomes]
    page = scrape(exporter_port)
    assert total(page, "qrq_cache_lookups_total", route="judged") == 240
    assert total(page, "qrq_cache_hits_total", route="judged") == 120
    assert total(page, "qrq_queue_depth") == 0
    assert total(page, "qrq_workers_alive") == 2
    # No page carries a prompt
    for port in (judge_port, fx_port, exporter_port):
        assert secret not in requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text


def test_retries_failovers_and_429s_are_counted(tmp_path, redis_url, stack):
    """A judge that fails every call: its calls tried again in their run, then failover to a
    healthy sibling once the circuit opens."""
    bad = stack.enter_context(spawn(MockJudgeSettings(latency_ms=5, error_rate=1.0)))
    good = stack.enter_context(spawn(MockJudgeSettings(latency_ms=5)))
    config_path = write_config(
        tmp_path,
        {"bad": judge_backend(bad.url, concurrency=4), "good": judge_backend(good.url)},
        redis_url=redis_url, routes={"pair": {"backends": ["bad", "good"],
                                              "weights": {"bad": 1000, "good": 1}}},
    )
    app = qrq.configure(qrq.load_config(config_path))
    bad_port = free_port()
    workers = start_workers(config_path, [
        ("bad", "bad@metrics", {"QRQ_METRICS_PORT": str(bad_port)}), ("good", "good@m")])
    for w in workers:
        stack.callback(w.stop)
    samples = [{"prompt": f"p{i}", "response": "r"} for i in range(10)]
    outcomes = qrq.submit_batch(samples, route="pair", app=app).outcomes()
    assert {o.status for o in outcomes} == {"ok"} and {o.backend for o in outcomes} == {"good"}
    page = scrape(bad_port)
    moved = total(page, "qrq_failovers_total", backend="bad", to="good")
    assert moved == total(page, "qrq_retries_total", backend="bad", reason="failover") >= 1
    assert total(page, "qrq_retries_total", backend="bad", reason="fault") >= 1
    assert total(page, "qrq_backend_requests_total", backend="bad", code="500") >= 5  # breaker: 5
    assert total(page, "qrq_samples_total", backend="bad") == 0  # nothing settled there


def test_grafana_dashboard_uses_only_exported_metric_names(tmp_path):
    """Every qrq_* series a dashboard panel queries is one a worker or the exporter exposes."""
    import json
    import re

    from prometheus_client import CollectorRegistry

    from qreward_queue.broker.app import QrqCelery
    from qreward_queue.ops import exporter, metrics

    registry = CollectorRegistry()
    metrics._WorkerMetrics(registry)
    config_path = write_config(tmp_path, {"ja": judge_backend(URL_UNUSED, rpm=60)},
                               routes={"r": {"backends": ["ja"], "cache": True}})
    app = QrqCelery(qrq.load_config(config_path))  # embedded: the exporter reads fakeredis
    families = [*registry.collect(), *exporter.RedisStateCollector(app).collect()]
    exported = set()
    for family in families:
        if family.name.startswith("qrq_"):
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
            exported |= {family.name + s for s in suffixes.get(family.type, [""])}
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "qrq-dashboard.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"\bqrq_[a-z0-9_]+", target["expr"])}
    assert queried and queried <= exported, queried - exported
    # and every exported series has a panel
    deprecated = {"qrq_rate_limit_per_minute", "qrq_bucket_level", "qrq_budget_limit",
                  "qrq_budget_used"}  # kept one release under their old names
    assert exported - queried <= {"qrq_limiter_wait_seconds_bucket", "qrq_bucket_requests",
                                  "qrq_bucket_tokens", "qrq_limit_tokens_per_second",
                                  "qrq_limiter_wait_seconds_count",
                                  "qrq_backend_latency_seconds_count", *deprecated}
