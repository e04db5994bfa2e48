"""The score cache, in-batch dedup, connection reuse and reward-model batching, end to end.

Real Redis, real `qrq worker` subprocesses, mock judges over HTTP; every expected score is
recomputed from the mock judge's rule.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import redis
from support import (
    expected,
    judge_backend,
    reward_model_backend,
    start_workers,
    write_route_config,
)

import qreward_queue
from qreward_queue.broker.cache import reward_identity
from qreward_queue.ops.status import queue_depth
from qreward_queue.testing.mock_judge import MockJudgeSettings, rm_verdict, spawn

FALLBACK = -1.0


@pytest.fixture
def judge(stack):
    return stack.enter_context(spawn(MockJudgeSettings(latency_ms=20, latency_cv=0.3)))


def worker(stack, config_path: Path, backend: str):
    (w,) = start_workers(config_path, [(backend, None)])
    stack.callback(w.kill)
    return w


def make_app(config_path: Path):
    return qreward_queue.configure(qreward_queue.load_config(config_path))


def samples_for(n: int, tag: str) -> list[dict]:
    return [
        {"id": f"{tag}-{i}", "prompt": f"{tag} question {i}", "response": f"answer {i * 11}"}
        for i in range(n)
    ]


def task_results(redis_url: str) -> int:
    client = redis.Redis.from_url(redis_url)
    try:
        return sum(1 for _ in client.scan_iter("qrq:celery-task-meta-*"))
    finally:
        client.close()


def cached_config(directory: Path, url: str, redis_url: str, **backend_keys) -> Path:
    return write_route_config(
        directory,
        {"j": judge_backend(url, **backend_keys)},
        redis_url=redis_url,
        routes={"graded": {"backends": ["j"], "cache": True, "cache_ttl_s": 600}},
        fallback_score=FALLBACK,
    )


# --------------------------------------------------------------------------------------------
# Score cache


def test_second_submission_is_served_from_cache(tmp_path, redis_url, judge, stack):
    # Given a route with the cache on, and 100 samples scored once
    config_path = cached_config(tmp_path, judge.url, redis_url)
    app = make_app(config_path)
    w = worker(stack, config_path, "j")
    samples = samples_for(100, "cache")
    first = qreward_queue.submit_batch(
        samples, route="graded", app=app, deadline_s=60
    ).outcomes(timeout=30)
    assert [o.status for o in first] == ["ok"] * 100
    assert [o.score for o in first] == [expected(app, "j", s) for s in samples]
    requests, results = judge.stats()["requests"], task_results(redis_url)
    assert requests == 100 and results == 0  # the client deletes the results it collected
    received = w.log.read_text().count("] received")

    # When the same samples are submitted again (under new ids)
    again = [{**s, "id": f"again-{i}"} for i, s in enumerate(samples)]
    batch = qreward_queue.submit_batch(again, route="graded", app=app, deadline_s=60)
    # Then nothing is queued: the batch is complete the moment it is returned
    assert batch._pending == {}
    assert queue_depth(app.store, app.backend_config("j").queue) == 0
    assert batch.done()
    outcomes = batch.outcomes(timeout=1)
    # and every sample is `cached`, with the first run's score and backend, under its own id
    assert [o.status for o in outcomes] == ["cached"] * 100
    assert [o.score for o in outcomes] == [o.score for o in first]
    assert {o.backend for o in outcomes} == {"j"}
    assert [o.id for o in outcomes] == [s["id"] for s in again]
    # and neither the judge nor a worker nor the result store saw anything
    assert judge.stats()["requests"] == requests
    assert task_results(redis_url) == results
    assert w.log.read_text().count("] received") == received


def test_changed_prompt_template_misses_the_cache(tmp_path, redis_url, judge, stack):
    # Given 100 samples scored and cached under one prompt template
    v1 = cached_config(tmp_path / "v1", judge.url, redis_url)
    app = make_app(v1)
    w1 = worker(stack, v1, "j")
    samples = samples_for(100, "template")
    first = qreward_queue.submit_batch(
        samples, route="graded", app=app, deadline_s=60
    ).outcomes(timeout=30)
    assert [o.status for o in first] == ["ok"] * 100
    old_identity = reward_identity(app.qrq_config, app.qrq_config.route("graded"))
    w1.kill()

    # When the backend's prompt template changes (a new config, same backend name and route)
    template = "Judge strictly.\nQ: {prompt}\nA: {response}\nReply 'Score: <0..1>'."
    v2 = cached_config(tmp_path / "v2", judge.url, redis_url, prompt_template=template)
    app = make_app(v2)
    assert reward_identity(app.qrq_config, app.qrq_config.route("graded")) != old_identity
    worker(stack, v2, "j")
    judge.reset()
    outcomes = qreward_queue.submit_batch(
        samples, route="graded", app=app, deadline_s=60
    ).outcomes(timeout=30)
    # Then every sample misses the cache and is scored again, with the new template
    assert [o.status for o in outcomes] == ["ok"] * 100
    assert judge.stats()["requests"] == 100
    assert [o.score for o in outcomes] == [expected(app, "j", s) for s in samples]
    assert sum(a.score != b.score for a, b in zip(first, outcomes, strict=True)) > 50
    # and the new scores are what the cache now answers under the new template
    cached = qreward_queue.submit_batch(samples, route="graded", app=app).outcomes(timeout=1)
    assert [o.status for o in cached] == ["cached"] * 100
    assert [o.score for o in cached] == [o.score for o in outcomes]


# --------------------------------------------------------------------------------------------
# In-batch dedup


def test_duplicates_are_scored_once_and_keep_their_own_ids(tmp_path, redis_url, judge, stack):
    # Given a plain route (no cache) and a batch of 100 with 10% duplicates under other ids
    config_path = write_route_config(
        tmp_path, {"j": judge_backend(judge.url)}, redis_url=redis_url,
        routes={"plain": {"backends": ["j"]}}, fallback_score=FALLBACK,
    )
    app = make_app(config_path)
    worker(stack, config_path, "j")
    distinct = samples_for(89, "dup")
    # one more differs from sample 0 only in `extra`: a different sample, not a duplicate
    distinct.append({**distinct[0], "id": "dup-extra", "extra": {"variant": 2}})
    samples = list(distinct)
    original_of = {}  # copy id -> original id
    for k in range(10):
        original = distinct[k * 7]
        samples.insert(5 + k * 9, {**original, "id": f"copy-{k}"})
        original_of[f"copy-{k}"] = original["id"]
    position = {s["id"]: i for i, s in enumerate(samples)}
    copies_of = {position[c]: position[o] for c, o in original_of.items()}
    assert len(samples) == 100 and len(copies_of) == 10
    # When it is scored
    outcomes = qreward_queue.submit_batch(
        samples, route="plain", app=app, deadline_s=60
    ).outcomes(timeout=30)
    # Then the judge saw exactly one request per distinct sample
    assert judge.stats()["requests"] == 90
    # and every sample is ok and right, duplicates with their original's score, own ids
    for i, (sample, outcome) in enumerate(zip(samples, outcomes, strict=True)):
        assert outcome.status == "ok", (i, outcome)
        assert outcome.score == expected(app, "j", sample), (i, outcome)
        assert outcome.id == sample["id"], (i, outcome)
    for i, j in copies_of.items():
        assert outcomes[i].score == outcomes[j].score
        assert outcomes[i].backend == outcomes[j].backend
        assert outcomes[i].id != outcomes[j].id


# --------------------------------------------------------------------------------------------
# Connection reuse and reward-model batching


def test_worker_reuses_http_connections(tmp_path, redis_url, judge, stack):
    # Given one worker with 8 threads
    config_path = write_route_config(
        tmp_path, {"j": judge_backend(judge.url, concurrency=8)}, redis_url=redis_url,
        fallback_score=FALLBACK,
    )
    app = make_app(config_path)
    worker(stack, config_path, "j")
    samples = samples_for(200, "conn")
    # When 200 samples are scored, one call each
    outcomes = qreward_queue.submit_batch(
        samples, route="j", app=app, deadline_s=60
    ).outcomes(timeout=30)
    assert [o.status for o in outcomes] == ["ok"] * 200
    assert [o.score for o in outcomes] == [expected(app, "j", s) for s in samples]
    # Then 200 requests went over at most one connection per call slot (keep-alive pool)
    stats = judge.stats()
    assert stats["requests"] == 200
    opened_by_worker = stats["connections_opened"] - 1  # this stats() request opened one
    calls = app.backend_config("j").pool.calls
    assert 1 <= opened_by_worker <= calls < 200, stats


def test_reward_model_scores_in_batches_of_batch_size(tmp_path, redis_url, judge, stack):
    # Given a route over the mock's /v1/rewards, 8 items per call
    config_path = write_route_config(
        tmp_path, {"rm": reward_model_backend(judge.url, batch_size=8)}, redis_url=redis_url,
        routes={"rm-route": {"backends": ["rm"]}}, fallback_score=FALLBACK,
    )
    app = make_app(config_path)
    worker(stack, config_path, "rm")
    n = 100
    samples = samples_for(n, "rm")
    # When 100 samples are scored
    outcomes = qreward_queue.submit_batch(
        samples, route="rm-route", app=app, deadline_s=60
    ).outcomes(timeout=30)
    # Then the server got ceil(100 / 8) calls holding all 100 items, and every score is its own
    stats = judge.stats()
    assert stats["requests"] == math.ceil(n / 8) == 13
    assert stats["items"] == n
    assert [o.status for o in outcomes] == ["ok"] * n
    assert [o.score for o in outcomes] == [rm_verdict(s["prompt"], s["response"]) for s in samples]
    assert [o.id for o in outcomes] == [s["id"] for s in samples]
