"""`qrq plan`: the binding limit of each backend, the predicted wall time, and the advice.

The prediction itself is checked against measured runs in benchmarks/plan_check.py; here the
model is checked limit by limit on backend files written to disk, and the command end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support import ROOT, function_backend, judge_backend, write_route_config

import qreward_queue as qrq
from qreward_queue.config.model import PACKAGED_CONFIG
from qreward_queue.ops.plan import Workload, plan_route, tokens_per_call

URL = "http://127.0.0.1:9"


def config_with(tmp_path, backends: dict, routes: dict | None = None):
    path = write_route_config(tmp_path, backends, routes=routes)
    return qrq.load_config(path), path


def test_rpm_binds_a_fast_pool(tmp_path):
    config, _ = config_with(tmp_path, {"ja": judge_backend(URL, rpm=3000, max_concurrent=64,
                                                           calls=32)})
    plan = plan_route(config, "ja", Workload(1024, latency_s=0.2, workers={"ja": 2}))
    (p,) = plan.backends
    assert p.binding == "rpm" and p.calls_per_s == 50
    # every call at 50/s (a full bucket's burst is not promised), the last takes 0.2 s
    assert plan.wall_s == pytest.approx(1024 / 50 + 0.2)
    assert p.rates["worker calls"] == 2 * 32 / 0.2 and p.rates["concurrency"] == 64 / 0.2


@pytest.mark.parametrize("n", [64, 1024, 8192])
@pytest.mark.parametrize("latency_ms", [5, 25, 200])
def test_a_plan_never_promises_more_than_the_summed_limits(n, latency_ms):
    # The demo's route: two judges of 6000 rpm; `qrq plan -n 1024 --latency-ms 25` once
    # predicted 247 samples/s against their 200/s
    config = qrq.load_config(PACKAGED_CONFIG)
    plan = plan_route(config, "demo", Workload(n, latency_s=latency_ms / 1000))
    limit_per_s = sum(config.backend(b).limits.rpm / 60 for b in ("mock-a", "mock-b"))
    assert n / plan.wall_s <= limit_per_s
    for p in plan.backends:
        assert p.samples / p.wall_s <= p.rates["rpm"]


def test_tpm_binds_long_samples_and_counts_the_template(tmp_path):
    backend = judge_backend(URL, rpm=6000, max_concurrent=64, calls=32)
    backend["limits"]["tpm"] = 60_000
    config, _ = config_with(tmp_path, {"ja": backend})
    work = Workload(600, prompt_tokens=300, response_tokens=600, latency_s=0.5)
    (p,) = plan_route(config, "ja", work).backends
    tokens = tokens_per_call(config.backend("ja"), work)
    # sample + max_tokens + the template's words and its fence around the response
    assert 900 + 16 < tokens < 900 + 16 + 120
    assert p.binding == "tpm" and p.calls_per_s == pytest.approx(1000 / tokens)


def test_worker_calls_then_concurrency_bind_as_latency_grows(tmp_path):
    config, _ = config_with(tmp_path, {"ja": judge_backend(URL, rpm=6000, max_concurrent=16,
                                                           calls=8)})
    (p,) = plan_route(config, "ja", Workload(100, latency_s=2.0)).backends
    assert p.binding == "worker calls" and p.calls_per_s == 4
    (p,) = plan_route(config, "ja", Workload(100, latency_s=2.0, workers={"ja": 4})).backends
    assert p.binding == "concurrency" and p.calls_per_s == 8


def test_a_route_splits_by_capacity_and_its_workers_share_the_cpu(tmp_path):
    config, _ = config_with(
        tmp_path,
        {"a": judge_backend(URL, rpm=1200, calls=64),
         "b": judge_backend(URL, rpm=3600, calls=64)},
        routes={"both": {"backends": ["a", "b"]}},
    )
    plan = plan_route(config, "both", Workload(800, latency_s=0.1, cores=8))
    assert [p.samples for p in plan.backends] == [200, 600]
    assert {p.binding for p in plan.backends} == {"rpm"}
    # on one core the two pools together need 80 calls/s x 11 ms = 0.88 core: still rpm
    assert {p.binding for p in plan_route(config, "both", Workload(800, latency_s=0.1,
                                                                  cores=1)).backends} == {"rpm"}
    # at 20 ms of CPU per call they need 1.6 cores: CPU binds both, rates shrink together
    slow = plan_route(config, "both", Workload(800, latency_s=0.1, cores=1, cpu_s_per_call=0.02))
    assert {p.binding for p in slow.backends} == {"CPU"}
    assert sum(p.calls_per_s for p in slow.backends) == pytest.approx(1 / 0.02)


def test_a_function_backend_is_bound_by_its_pool_or_the_cores(tmp_path):
    config, _ = config_with(tmp_path, {"fx": function_backend("m:f", chunk_size=64,
                                                              concurrency=2)})
    work = Workload(8192, cpu_s_per_sample=0.002, cores=4)
    (p,) = plan_route(config, "fx", work).backends
    assert p.calls == 128 and p.binding == "worker calls"
    assert p.calls_per_s == pytest.approx(2 / (64 * 0.002))


def test_advice_names_what_to_change_for_a_target(tmp_path):
    config, _ = config_with(tmp_path, {"ja": judge_backend(URL, rpm=600, max_concurrent=64,
                                                           calls=4)})
    plan = plan_route(config, "ja", Workload(600, latency_s=1.0), target_s=20)
    # 4 threads at 1 s: 4 calls/s; 600 in 20 s needs ~31/s, above the 10/s rpm allows
    assert plan.backends[0].binding == "worker calls"
    text = "\n".join(plan.advice)
    assert "ja: rpm caps it at 10.0 samples/s" in text
    assert "ja: run 3 workers (now 1)" in text  # enough threads to reach the rpm cap
    assert "add a backend to route ja" in text and "rpm" in text
    assert plan_route(config, "ja", Workload(60, latency_s=1.0), target_s=60).advice == []


def test_qrq_plan_prints_the_table_and_json(tmp_path):
    _, path = config_with(tmp_path, {"ja": judge_backend(URL, rpm=3000, max_concurrent=64,
                                                         calls=32)})
    env = {**os.environ, "QRQ_CONFIG": str(path)}

    def plan(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "qreward_queue.cli", "plan", *args],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)

    out = plan("--route", "ja", "-n", "1024", "--latency-ms", "200", "--workers", "ja=2",
               "--target-s", "10")
    assert out.returncode == 0, out.stderr
    assert "predicted wall time 20.7 s" in out.stdout
    assert "target 10 s: misses it" in out.stdout and "rpm caps it" in out.stdout
    data = json.loads(plan("--route", "ja", "-n", "1024", "--latency-ms", "200",
                           "--workers", "ja=2", "--json").stdout)
    assert data["backends"][0]["binding"] == "rpm" and data["wall_s"] == pytest.approx(20.68)
    bad = plan("--route", "ja", "-n", "10", "--workers", "nope=2")
    assert bad.returncode == 2
    assert bad.stderr.strip() == ("qrq: error: --workers 'nope=2': expected BACKEND=N with a "
                                  "known backend")
