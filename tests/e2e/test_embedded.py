"""Embedded mode end to end: configure() -> submit_batch -> in-process workers -> a real mock judge.

No Redis: in-memory broker and results, in-process worker threads. Each test configures its own
app (the fixture), so no state leaks from one test to the next.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from support import judge_backend, wait_for, write_config

import qreward_queue
from qreward_queue.backends import JudgeOptions
from qreward_queue.backends.judge import JudgeBackend
from qreward_queue.broker.app import QrqCelery
from qreward_queue.config.loader import load_config
from qreward_queue.config.model import Backend, Config
from qreward_queue.errors import InvalidSamples, UnknownRoute
from qreward_queue.testing.mock_judge import MockJudge, MockJudgeSettings, rm_verdict, verdict

FALLBACK = -1.0  # qrq.toml's fallback_score in these tests: never mistaken for a real score


@pytest.fixture(autouse=True)
def embedded_env(monkeypatch):
    monkeypatch.delenv("QRQ_REDIS_URL", raising=False)
    monkeypatch.delenv("QRQ_CONFIG", raising=False)


@pytest.fixture
def make_judge() -> Iterator[Callable[..., MockJudge]]:
    judges: list[MockJudge] = []

    def make(**settings: Any) -> MockJudge:
        options = {"latency_ms": 2, "latency_cv": 0, "hang_s": 3, **settings}
        judges.append(MockJudge(MockJudgeSettings(**options)).start())
        return judges[-1]

    yield make
    for judge in judges:
        judge.stop()


@pytest.fixture
def judge(make_judge) -> MockJudge:
    return make_judge()


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Callable[..., Config]]:
    """Write qrq.toml + workers/ for the given backends, load it and configure() embedded mode."""

    def make(backends: dict[str, dict], routes: dict[str, list[str]], **defaults: Any) -> Config:
        defaults = {"fallback_score": FALLBACK, **defaults}
        config = load_config(write_config(tmp_path, backends, routes=routes, **defaults))
        assert config.embedded
        app = qreward_queue.configure(config)
        assert app.qrq_config is config and qreward_queue.get_app() is app
        return config

    yield make
    # stop this test's worker threads; the next test starts from nothing
    qreward_queue.configure(Config(redis_url=None, backends={}, routes={}))


def samples_(n: int, start: int = 0) -> list[dict]:
    return [
        {"prompt": f"What is {i} * 3?", "response": f"{3 * i}", "reference": str(3 * i), "id": i}
        for i in range(start, start + n)
    ]


def expected(config: Config, backend: str, samples: list[dict]) -> list[float]:
    renderer = JudgeBackend(config.backends[backend])
    return [verdict(renderer.render(s)) for s in samples]


def judge_setup(setup, judge: MockJudge, concurrency: int = 16, **backend: Any) -> Config:
    return setup(
        {"a": judge_backend(judge.url, concurrency=concurrency, **backend)},
        routes={"grade": ["a"]},
        route="grade",
    )


# --- happy path ------------------------------------------------------------------------------


def test_64_samples_come_back_in_input_order_with_the_judges_verdicts(setup, judge):
    config = setup(
        {
            "a": judge_backend(judge.url, concurrency=16),
            "b": judge_backend(judge.url, concurrency=16),
        },
        routes={"both": ["a", "b"]},
        route="both",
    )
    samples = samples_(64)
    batch = qreward_queue.submit_batch(samples, route="both")
    assert len(batch) == 64
    scores = batch.get(timeout=30)
    assert scores == expected(config, "a", samples)  # both backends share the template
    outcomes = batch.outcomes()
    assert [o.id for o in outcomes] == list(range(64))
    assert {o.status for o in outcomes} == {"ok"}
    assert {o.backend for o in outcomes} == {"a", "b"}  # the route spread the work
    for outcome, score in zip(outcomes, scores, strict=True):
        assert outcome.score == score
        assert outcome.attempts >= 1
        assert isinstance(outcome.latency_ms, float) and outcome.latency_ms > 0
        assert outcome.error is None
        assert outcome.detail.endswith(f"Score: {score:.2f}")
    assert batch.done() and batch.completed == 64
    assert judge.stats()["accepted"] == 64
    # and the step's summary adds up to the batch
    summary = batch.summary()
    assert summary["samples"] == 64 and summary["by_status"] == {"ok": 64}
    assert sum(summary["by_backend"].values()) == 64 and set(summary["by_backend"]) == {"a", "b"}
    assert summary["retries"] == 0 and summary["cache_hits"] == 0 and summary["wall_s"] > 0


def test_score_returns_floats_for_the_default_route_at_every_priority(setup, judge):
    config = judge_setup(setup, judge)
    for k, priority in enumerate(("val", "train", "bulk")):
        samples = samples_(3, start=10 * k)
        scores = qreward_queue.score(samples, priority=priority)  # route=None: the default
        assert all(type(s) is float for s in scores)
        assert scores == expected(config, "a", samples)


def test_done_completed_and_a_get_timeout_before_the_deadline(setup, make_judge):
    judge = make_judge(latency_ms=400)
    config = judge_setup(setup, judge)
    samples = samples_(4)
    batch = qreward_queue.submit_batch(samples, route="grade")
    assert len(batch) == 4
    assert not batch.done() and batch.completed == 0  # every call takes 400 ms
    with pytest.raises(TimeoutError, match="call get\\(\\) again"):
        batch.get(timeout=0.05)
    assert batch.get(timeout=30) == expected(config, "a", samples)
    assert batch.done() and batch.completed == 4


def test_await_does_not_block_the_event_loop(setup, make_judge):
    judge = make_judge(latency_ms=100)
    config = judge_setup(setup, judge, concurrency=4, calls=4)
    samples = samples_(12)

    async def main() -> tuple[list[float], int, float]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        started = time.monotonic()
        scores = await qreward_queue.submit_batch(samples, route="grade")
        elapsed = time.monotonic() - started
        task.cancel()
        return scores, ticks, elapsed

    scores, ticks, elapsed = asyncio.run(main())
    assert scores == expected(config, "a", samples)
    assert elapsed >= 0.25  # 12 calls of 100 ms, 4 at a time
    assert ticks >= 10, f"the loop ticked {ticks} times in {elapsed:.2f} s"


# --- bad input ---------------------------------------------------------------------------------


def test_invalid_samples_become_error_outcomes_while_the_rest_is_scored(setup, judge):
    config = judge_setup(setup, judge)
    good = samples_(4)
    batch_in = [
        good[0],
        {"prompt": "p"},
        good[1],
        "not a sample",
        good[2],
        {**good[3], "extra": [1]},
        good[3],
        {"prompt": "p", "response": "r", "scroe": 1},
    ]
    batch = qreward_queue.submit_batch(batch_in, route="grade", on_invalid="outcome")
    outcomes = batch.outcomes(timeout=30)
    want = expected(config, "a", good)
    for i, k in zip((0, 2, 4, 6), range(4), strict=True):
        assert (outcomes[i].status, outcomes[i].score) == ("ok", want[k])
    reasons = {
        1: "missing field 'response'",
        3: "expected a dict",
        5: "field 'extra' must be a JSON object",
        7: "unknown field(s) 'scroe'",
    }
    for i, reason in reasons.items():
        assert outcomes[i].status == "error" and outcomes[i].score == FALLBACK
        assert outcomes[i].error.startswith(f"invalid sample {i}: ") and reason in outcomes[i].error
        assert outcomes[i].backend is None and outcomes[i].attempts == 0
    assert [o.id for o in outcomes] == [0, None, 1, None, 2, 3, 3, None]  # ids kept when known
    assert judge.stats()["accepted"] == 4


def test_invalid_samples_raise_before_anything_is_queued(setup, judge):
    judge_setup(setup, judge)
    batch_in = [*samples_(3), {"prompt": "p", "response": 1}, {"response": "r"}]
    with pytest.raises(InvalidSamples) as info:
        qreward_queue.submit_batch(batch_in, route="grade")
    assert set(info.value.problems) == {3, 4}
    assert "sample 3: field 'response' must be a string" in str(info.value)
    assert "sample 4: missing field 'prompt'" in str(info.value)
    assert judge.stats()["requests"] == 0
    # a later batch runs through the same queue; nothing of the rejected one went before it
    assert len(qreward_queue.score(samples_(1, start=100), route="grade")) == 1
    assert judge.stats()["requests"] == 1


# --- checks before anything is queued (an app without worker threads: nothing consumes) --------


@pytest.fixture
def idle_app(judge) -> Iterator[QrqCelery]:
    """An embedded app whose queue nobody consumes, so whatever was published stays there."""
    name = f"idle{time.monotonic_ns()}"
    backend = Backend(name=name, kind="judge", options=JudgeOptions(url=judge.url + "/v1",
                      model="m"))
    app = QrqCelery(Config(redis_url=None, backends={name: backend}, routes={}))
    yield app
    with app.connection_for_write() as conn:
        conn.SimpleQueue(backend.queue).clear()


def queued(app: QrqCelery) -> int:
    (backend,) = app.qrq_config.backends.values()
    with app.connection_for_read() as conn:
        return conn.SimpleQueue(backend.queue).qsize()


def test_bad_calls_are_refused_before_anything_is_queued(idle_app):
    (name,) = idle_app.qrq_config.backends
    submit = qreward_queue.submit_batch
    with pytest.raises(UnknownRoute) as info:
        submit(samples_(1), route="gradee", app=idle_app)
    assert "'gradee'" in str(info.value) and f"known: {name}" in str(info.value)
    with pytest.raises(ValueError, match="priority must be one of val, train, bulk"):
        submit(samples_(1), route=name, priority="urgent", app=idle_app)
    with pytest.raises(ValueError, match="on_invalid"):
        submit(samples_(1), route=name, on_invalid="skip", app=idle_app)
    with pytest.raises(InvalidSamples, match="samples must be a list"):
        submit({"prompt": "p", "response": "r"}, route=name, app=idle_app)
    with pytest.raises(InvalidSamples):
        submit([*samples_(3), {"prompt": "p"}], route=name, app=idle_app)
    assert queued(idle_app) == 0


def test_empty_and_all_invalid_batches_return_at_once(idle_app):
    (name,) = idle_app.qrq_config.backends
    empty = qreward_queue.submit_batch([], route=name, app=idle_app)
    assert empty.done() and len(empty) == 0 and empty.get() == []
    invalid = qreward_queue.submit_batch(
        [1, {"prompt": "p", "id": "x"}], route=name, on_invalid="outcome", app=idle_app
    )
    assert invalid.done() and invalid.completed == 2
    outcomes = invalid.outcomes()
    assert [o.status for o in outcomes] == ["error", "error"]
    assert [o.id for o in outcomes] == [None, "x"]
    assert queued(idle_app) == 0


def test_a_small_batch_is_one_task_expiring_at_the_deadline(idle_app):
    # (a chunk's calls run at once: splitting 3 samples would cost 3 tasks for no speed)
    (name,) = idle_app.qrq_config.backends
    batch = qreward_queue.submit_batch(samples_(3), route=name, deadline_s=5, app=idle_app)
    assert queued(idle_app) == 1 and not batch.done()
    with idle_app.connection_for_read() as conn:
        message = conn.SimpleQueue(idle_app.qrq_config.backends[name].queue).get(timeout=5)
    # Celery reads a number as "seconds from now": the task must die with the batch
    expires = datetime.fromisoformat(message.headers["expires"]).timestamp()
    assert abs(expires - batch.deadline) < 2.0


# --- failures inside a batch -----------------------------------------------------------------


def test_garbage_400_and_500_samples_error_while_the_rest_is_ok(setup, judge):
    config = judge_setup(setup, judge)
    good = samples_(6)
    batch_in = [
        good[0],
        {"prompt": "p", "response": "[[mock:garbage]]", "id": "g"},
        good[1],
        {"prompt": "p", "response": "[[mock:400]]", "id": "4xx"},
        good[2],
        {"prompt": "p", "response": "[[mock:500]]", "id": "5xx"},
        *good[3:],
    ]
    outcomes = qreward_queue.submit_batch(batch_in, route="grade").outcomes(timeout=30)
    want = expected(config, "a", good)
    ok = [o for o in outcomes if o.status == "ok"]
    assert [o.score for o in ok] == want and [o.id for o in ok] == list(range(6))
    garbage, bad_request, server_error = outcomes[1], outcomes[3], outcomes[5]
    for outcome, sample_id in ((garbage, "g"), (bad_request, "4xx"), (server_error, "5xx")):
        assert outcome.status == "error" and outcome.score == FALLBACK
        assert outcome.backend == "a" and outcome.id == sample_id
    assert "no score in the judge's reply" in garbage.error
    assert garbage.detail == "I cannot decide."
    assert garbage.attempts == 1  # never retried blindly
    assert "request rejected with 400" in bad_request.error and bad_request.attempts == 1
    assert "server error 500" in server_error.error
    assert server_error.attempts >= 3  # retried (attempts = 3 in the backend file), then gave up
    # no worker died: the same threads score the next batch
    follow_up = samples_(2, start=50)
    assert qreward_queue.score(follow_up, route="grade") == expected(config, "a", follow_up)


def test_reward_model_batch_isolates_its_bad_item(setup, judge):
    setup(
        {
            "rm": {
                "backend": {"kind": "reward_model", "url": judge.url + "/v1/rewards",
                            "batch_size": 8, "timeout_s": 10},
                "pool": {"type": "threads", "concurrency": 4},
            }
        },
        routes={"rm": ["rm"]},
    )
    samples = samples_(16)
    samples[9] = {"prompt": "p", "response": "[[mock:400]]", "id": 9}
    outcomes = qreward_queue.submit_batch(samples, route="rm").outcomes(timeout=30)
    assert outcomes[9].status == "error" and "400" in outcomes[9].error
    for i, outcome in enumerate(outcomes):
        if i != 9:
            assert outcome.status == "ok"
            assert outcome.score == rm_verdict(samples[i]["prompt"], samples[i]["response"])
    assert [o.id for o in outcomes] == list(range(16))


def test_function_reward_errors_per_sample(setup, judge):
    setup(
        {
            "exact": {
                "backend": {"kind": "function", "chunk_size": 4,
                            "function": "qreward_queue.rewards.basic:exact_match"},
                "pool": {"type": "threads", "concurrency": 2},
            }
        },
        routes={},
    )
    samples = samples_(10)
    samples[1]["response"] = "wrong: 1000"
    del samples[6]["reference"]
    outcomes = qreward_queue.submit_batch(samples, route="exact").outcomes(timeout=30)
    assert [o.score for o in outcomes] == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, FALLBACK, 1.0, 1.0, 1.0]
    assert outcomes[6].status == "error" and "needs the sample's 'reference'" in outcomes[6].error
    assert all(o.status == "ok" for i, o in enumerate(outcomes) if i != 6)


def test_deadline_gives_timeout_with_the_fallback_and_returns_on_time(setup, judge):
    # the call outlives the judge's 3 s hang, so only the 2 s batch deadline can end the wait
    config = judge_setup(setup, judge, timeout_s=10.0)
    good = samples_(5)
    batch_in = [*good[:2], {"prompt": "p", "response": "[[mock:hang]]", "id": "h"}, *good[2:]]
    batch = qreward_queue.submit_batch(batch_in, route="grade", deadline_s=2.0)
    wait_for(lambda: batch.completed == 5, 10, "the five good samples")
    assert not batch.done()  # the hanging one is still out
    outcomes = batch.outcomes()
    # deadline promise: outcomes() returns by the batch deadline, not at the end of the hang
    assert time.time() < batch.deadline + 0.8
    hung = outcomes[2]
    assert hung.status == "timeout" and hung.score == FALLBACK and hung.id == "h"
    assert "deadline" in hung.error
    ok = [o for i, o in enumerate(outcomes) if i != 2]
    assert [o.score for o in ok] == expected(config, "a", good)
    assert {o.status for o in ok} == {"ok"}
    assert batch.done() and batch.completed == 6


def test_a_chunks_finished_samples_arrive_before_its_hanging_one(setup, judge):
    config = judge_setup(setup, judge, chunk_size=8)  # the 8 samples: one task
    samples = samples_(8)
    samples[3]["response"] = "[[mock:hang]]"  # answered after the judge's 3 s hang
    batch = qreward_queue.submit_batch(samples, route="grade")
    wait_for(lambda: batch.completed == 7, 10, "the seven fast samples")
    early = batch.partial()
    assert early[3] is None and not batch.done()
    outcomes = batch.outcomes()
    assert [o for i, o in enumerate(outcomes) if i != 3] == [o for o in early if o is not None]
    assert [o.score for o in outcomes] == expected(config, "a", samples)


def test_embedded_mode_runs_the_same_lua_limiter_on_fakeredis(setup, make_judge):
    # Given a judge that answers 429 above 600 rpm (10/s, a bucket of 10) and 4 concurrent
    judge = make_judge(rpm=600, max_concurrent=4, latency_ms=20)
    config = judge_setup(setup, judge, concurrency=16, rpm=600, max_concurrent=4)
    # When 40 samples are scored in embedded mode
    app = qreward_queue.get_app()
    outcomes = qreward_queue.submit_batch(samples_(40), route="grade").outcomes()
    # Then the limiter's Lua ran in-process on fakeredis and held the judge's limits
    assert type(app.store).__module__.startswith("fakeredis")
    assert app.store.exists("qrq:{a}:bucket") and app.store.exists("qrq:{a}:aimd")
    stats = judge.stats()
    # (at exactly the limit, arrival jitter may cost one 429, which is retried, not scored)
    assert stats["rate_limited"] <= 1 and stats["peak_in_flight"] <= 4
    assert [o.status for o in outcomes] == ["ok"] * 40
    assert [o.score for o in outcomes] == expected(config, "a", samples_(40))


def test_an_embedded_worker_leaves_the_trainers_garbage_collector_alone(setup, judge):
    # Given a trainer process with nothing frozen out of its collector's sight
    gc.unfreeze()
    judge_setup(setup, judge)
    # When its embedded worker starts and scores a batch
    assert len(qreward_queue.submit_batch(samples_(4)).get(timeout=30)) == 4
    # Then the trainer's objects are still collected (a worker process freezes its own)
    assert gc.get_freeze_count() == 0
