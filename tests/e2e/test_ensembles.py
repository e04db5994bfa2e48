"""Judge ensembles end to end: real `qrq worker`s, real Redis, mock judges over HTTP.

A route with `votes = k` scores each sample k times (vote j on its backend j mod n, no
failover between them), aggregates the votes and keeps every vote, the spread and the failed
count in the outcome's detail; a judge that is down costs its vote, not the sample, until the
votes left fall below the quorum: then the sample is an `error` naming the count.
"""

from __future__ import annotations

import json
import statistics

import pytest
from support import free_port, judge_backend, start_workers, write_route_config

import qreward_queue
from qreward_queue.backends.judge import JudgeBackend
from qreward_queue.config.loader import load_config
from qreward_queue.errors import ConfigError
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn, verdict

TEMPLATES = {
    "ja": "Judge A. Prompt: {prompt}\nResponse: {response}\nAnswer 'Score: <x>'.",
    "jb": "Judge B grades strictly. {prompt} || {response}\nAnswer 'Score: <x>'.",
}
SAMPLES = [{"prompt": f"What is {i} + {i}?", "response": str(2 * i + i % 2)} for i in range(12)]


def judges(url_a: str, url_b: str, url_down: str) -> dict[str, dict]:
    tables = {name: judge_backend(url, prompt_template=TEMPLATES[name], score_range=[0, 1])
              for name, url in (("ja", url_a), ("jb", url_b))}
    tables["jdown"] = judge_backend(url_down)
    for t in tables.values():  # a judge that is down gives up soon
        t["retry"] = {"attempts": 2, "backoff_base_s": 0.05, "backoff_cap_s": 0.1}
    return tables


@pytest.fixture
def ensemble(tmp_path, redis_url, stack):
    a = stack.enter_context(spawn(MockJudgeSettings(latency_ms=10)))
    b = stack.enter_context(spawn(MockJudgeSettings(latency_ms=10)))
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    path = write_route_config(tmp_path, judges(a.url, b.url, down), redis_url, routes={
        "panel": {"backends": ["ja", "jb", "jdown"], "votes": 3, "quorum": 2},
        "strict": {"backends": ["ja", "jb", "jdown"], "votes": 3, "quorum": 3,
                   "aggregate": "min"},
        "again": {"backends": ["ja"], "votes": 3, "aggregate": "median", "cache": True},
    })
    for worker in start_workers(path, [("ja", "ja"), ("jb", "jb"), ("jdown", "jdown")]):
        stack.enter_context(worker)
    app = qreward_queue.configure(load_config(path))
    return app, a, b


def score_of(app, backend: str, sample: dict) -> float:
    return verdict(JudgeBackend(app.backend_config(backend)).render(sample))


def test_one_judge_down_still_meets_the_quorum_and_every_vote_is_kept(ensemble) -> None:
    app, a, b = ensemble
    outcomes = qreward_queue.submit_batch(SAMPLES, route="panel", app=app).outcomes()
    for sample, outcome in zip(SAMPLES, outcomes, strict=True):
        va, vb = score_of(app, "ja", sample), score_of(app, "jb", sample)
        assert outcome.status == "ok", outcome
        assert outcome.score == pytest.approx(statistics.fmean([va, vb]))
        detail = json.loads(outcome.detail)
        assert [v["judge"] for v in detail["votes"]] == ["ja", "jb", "jdown"]
        assert [v.get("score") for v in detail["votes"][:2]] == [va, vb]
        assert detail["votes"][2]["status"] == "error"
        assert "connection" in detail["votes"][2]["error"]
        assert detail["failed"] == 1 and detail["spread"] == pytest.approx(abs(va - vb))
    assert a.stats()["accepted"] == b.stats()["accepted"] == len(SAMPLES)


def test_below_the_quorum_is_an_error_with_every_vote(ensemble) -> None:
    app, _, _ = ensemble
    outcomes = qreward_queue.submit_batch(SAMPLES[:3], route="strict", app=app).outcomes()
    for outcome in outcomes:
        assert outcome.status == "error" and outcome.score == 0.0, outcome
        assert "2 of 3 judges scored, the quorum is 3 (1 failed)" in outcome.error
        assert json.loads(outcome.detail)["failed"] == 1


def test_one_judge_asked_three_times_and_the_cache_keys_the_whole_ensemble(ensemble) -> None:
    app, a, _ = ensemble
    first = qreward_queue.submit_batch(SAMPLES[:4], route="again", app=app).outcomes()
    assert a.stats()["accepted"] == 12  # three distinct calls per sample (seed = vote)
    for sample, outcome in zip(SAMPLES, first, strict=False):
        assert outcome.score == score_of(app, "ja", sample)  # the mock judge is deterministic
        assert [v["judge"] for v in json.loads(outcome.detail)["votes"]] == ["ja"] * 3
    again = qreward_queue.submit_batch(SAMPLES[:4], route="again", app=app).outcomes()
    assert [o.status for o in again] == ["cached"] * 4
    assert a.stats()["accepted"] == 12
    # the same judge on its own (no ensemble) is another reward: not served from that cache
    assert qreward_queue.submit_batch(SAMPLES[:1], route="ja", app=app).outcomes()[0].status \
        == "ok"


def test_ensemble_keys_are_checked_with_one_line_naming_file_and_key(tmp_path) -> None:
    backends = {"ja": judge_backend("http://127.0.0.1:1"),
                "jg": judge_backend("http://127.0.0.1:1", mode="group")}
    for table, key in [({"backends": ["ja"], "votes": 0}, "routes.r.votes"),
                       ({"backends": ["ja"], "votes": 2, "aggregate": "max"}, "routes.r.aggregate"),
                       ({"backends": ["ja"], "votes": 2, "quorum": 3}, "routes.r.quorum"),
                       ({"backends": ["ja"], "quorum": 1}, "routes.r.quorum"),
                       ({"backends": ["jg"], "votes": 2}, "routes.r.votes"),
                       ({"backends": ["ja", "jg"]}, "routes.r.backends")]:
        path = write_route_config(tmp_path, backends, routes={"r": table})
        with pytest.raises(ConfigError) as caught:
            load_config(path)
        message = str(caught.value)
        assert "qrq.toml" in message and key in message and "\n" not in message, message


def test_plan_counts_every_vote_on_its_judge(tmp_path) -> None:
    from qreward_queue.ops.plan import Workload, plan_route

    backends = {name: judge_backend("http://127.0.0.1:1") for name in ("ja", "jb")}
    path = write_route_config(tmp_path, backends, routes={
        "pair": {"backends": ["ja", "jb"], "votes": 2},
        "thrice": {"backends": ["ja"], "votes": 3},
    })
    config = load_config(path)
    assert [(p.backend, p.calls) for p in plan_route(config, "pair", Workload(100)).backends] \
        == [("ja", 100), ("jb", 100)]
    assert [p.calls for p in plan_route(config, "thrice", Workload(100)).backends] == [300]
