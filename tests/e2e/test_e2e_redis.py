"""End to end on real Redis: real `qrq worker` subprocesses, mock judges over real HTTP.

No eager mode and no fakeredis: the client publishes to Redis, workers consume from their
backend's queue `qrq.<backend>`, call the mock judge on 127.0.0.1 and store results in Redis.
Every expected score is recomputed from the mock judge's rule (`verdict` / `rm_verdict`).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import redis
from support import (
    Worker,
    function_backend,
    judge_backend,
    redis_contents,
    reward_model_backend,
    tasks_received,
    wait_for,
    with_message_bodies,
    write_config,
)

import qreward_queue
from qreward_queue.backends.judge import JudgeBackend
from qreward_queue.rewards.basic import exact_match
from qreward_queue.testing.mock_judge import MockJudgeSettings, rm_verdict, spawn, verdict

FALLBACK = -1.0  # a fallback score no judge can give, so a silently zeroed reward shows


@pytest.fixture
def judge():
    """A fast mock judge subprocess (no limits)."""
    with spawn(MockJudgeSettings(latency_ms=20, latency_cv=0.3)) as mock:
        yield mock


def make_app(config_path: Path):
    return qreward_queue.configure(qreward_queue.load_config(config_path))


def samples_for(n: int, tag: str = "s") -> list[dict]:
    return [
        {"prompt": f"{tag} question {i}", "response": f"answer {i * 7}", "reference": str(i)}
        for i in range(n)
    ]


def expected_judge_score(config, outcome, sample) -> float:
    """What the mock judge says about the exact text this backend sends for `sample`."""
    return verdict(JudgeBackend(config.backend(outcome.backend)).render(sample))


def assert_scores_correct(config, samples, outcomes) -> None:
    assert len(outcomes) == len(samples)
    for i, (sample, outcome) in enumerate(zip(samples, outcomes, strict=True)):
        assert outcome.status == "ok", (i, outcome)
        assert outcome.score == expected_judge_score(config, outcome, sample), (i, outcome)


def assert_worker_alive(worker: Worker) -> None:
    assert worker.proc.poll() is None, worker.log.read_text()[-3000:]


# --------------------------------------------------------------------------------------------
# Two judges behind one route


def test_route_over_two_judges_scores_in_input_order(tmp_path, redis_url):
    # Given two mock judges, one backend and one worker each, and a route over both
    with (
        spawn(MockJudgeSettings(latency_ms=20, latency_cv=0.3, seed=1)) as judge_a,
        spawn(MockJudgeSettings(latency_ms=20, latency_cv=0.3, seed=2)) as judge_b,
    ):
        config_path = write_config(
            tmp_path,
            {"ja": judge_backend(judge_a.url), "jb": judge_backend(judge_b.url)},
            redis_url=redis_url,
            routes={"both": ["ja", "jb"]},
            fallback_score=FALLBACK,
        )
        app = make_app(config_path)
        config = app.qrq_config
        samples = samples_for(200)
        with Worker(config_path, "ja"), Worker(config_path, "jb"):
            # When 200 samples are submitted on the route
            batch = qreward_queue.submit_batch(samples, route="both", app=app, deadline_s=120)
            outcomes = batch.outcomes(timeout=60)
        # Then each sample's score is the verdict on its own rendered text, in input order
        assert_scores_correct(config, samples, outcomes)
        assert batch.get() == [o.score for o in outcomes]
        # and both backends took a share, each one matching what its judge actually served
        used = {name: sum(o.backend == name for o in outcomes) for name in ("ja", "jb")}
        assert used["ja"] > 0 and used["jb"] > 0, used
        assert used["ja"] + used["jb"] == 200
        assert judge_a.stats()["accepted"] == used["ja"]
        assert judge_b.stats()["accepted"] == used["jb"]


# --------------------------------------------------------------------------------------------
# Serialization: a pickled message must never run


class _Hostile:
    """Unpickling this creates a directory: proof that the worker deserialized pickle."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_pickled_message_is_refused_and_worker_keeps_scoring(tmp_path, redis_url, judge):
    # Given a worker on a judge backend
    config_path = write_config(
        tmp_path, {"j": judge_backend(judge.url)}, redis_url=redis_url, fallback_score=FALLBACK
    )
    app = make_app(config_path)
    queue = app.qrq_config.backend("j").queue
    marker = tmp_path / "unpickled"
    client = redis.Redis.from_url(redis_url)
    with Worker(config_path, "j") as worker:
        # When a pickled task message is published straight to its queue
        sample = {"prompt": "pickled", "response": "payload"}
        result = app.send_task(
            "qrq.score_chunk",
            kwargs={"backend": "j", "samples": [sample], "hostile": _Hostile(marker)},
            serializer="pickle",
            queue=queue,
            priority=0,
        )
        wait_for(
            lambda: "application/x-python-serialize" in worker.log.read_text(),
            timeout_s=20,
            what="the worker to log the refused content type",
        )
        # Then the worker refused it: nothing was unpickled, nothing ran, nothing was stored
        log = worker.log.read_text()
        assert "Refusing to deserialize untrusted content of type pickle" in log
        assert not marker.exists(), "the worker unpickled the message"
        assert judge.stats()["requests"] == 0
        assert result.state == "PENDING"
        assert not client.exists(f"qrq:celery-task-meta-{result.id}")
        # and the message was discarded, not left to loop between the queue and `unacked`
        queue_keys = [k for k in client.scan_iter(f"qrq:{queue}*")]
        assert sum(client.llen(k) for k in queue_keys) == 0
        assert client.hlen("qrq:unacked") == 0
        # and the worker is still alive and scores a normal batch
        assert_worker_alive(worker)
        samples = samples_for(10)
        batch = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=60)
        outcomes = batch.outcomes(timeout=30)
        assert_scores_correct(app.qrq_config, samples, outcomes)
        assert judge.stats()["requests"] == 10
        assert_worker_alive(worker)
    client.close()


# --------------------------------------------------------------------------------------------
# Secrets stay in the worker's environment


SECRET = "sk-secret-123"


class PubSubRecorder:
    """Records every Redis pub/sub message (task events, result notifications) while running."""

    def __init__(self, url: str):
        self.client = redis.Redis.from_url(url)
        db = self.client.connection_pool.connection_kwargs.get("db", 0)
        self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        # kombu's fanout channels (events, pidbox) name the database: "qrq:/<db>.celeryev/..."
        self.pubsub.psubscribe(f"*/{db}.*", "qrq:celery-task-meta-*")
        self.messages: list[tuple[bytes, bytes]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            message = self.pubsub.get_message(timeout=0.1)
            if message and isinstance(message.get("data"), bytes):
                self.messages.append((message["channel"], message["data"]))

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(5)
        self.pubsub.close()
        self.client.close()


def test_api_key_never_reaches_redis_or_logs(tmp_path, redis_url, judge, monkeypatch):
    # Given two backends whose key lives only in the workers' environment, routed together so
    # that failing samples are republished by a worker (retry onto the sibling's queue)
    monkeypatch.delenv("QRQ_TEST_KEY", raising=False)
    backends = {name: judge_backend(judge.url, api_key_env="QRQ_TEST_KEY") for name in ("ka", "kb")}
    config_path = write_config(
        tmp_path,
        backends,
        redis_url=redis_url,
        routes={"keyed": ["ka", "kb"]},
        fallback_score=FALLBACK,
    )
    app = make_app(config_path)
    client = redis.Redis.from_url(redis_url)
    samples = samples_for(40, tag="secret")
    failing = {5, 21}
    for i in failing:
        samples[i]["response"] += " [[mock:500]]"
    recorder = PubSubRecorder(redis_url)
    worker_env = {"QRQ_TEST_KEY": SECRET}
    try:
        # When a batch is queued (Redis is dumped now and all along: queues, unacked, results)
        batch = qreward_queue.submit_batch(samples, route="keyed", app=app, deadline_s=90)
        snapshots = redis_contents(client)
        queued = [text for _, value in snapshots for text in with_message_bodies(value)]
        with (
            Worker(config_path, "ka", extra_env=worker_env, extra_args=("--events",)) as worker_a,
            Worker(config_path, "kb", extra_env=worker_env, extra_args=("--events",)) as worker_b,
        ):
            # and scored by workers that hold the key (and send task events, as with Flower)

            def dump_until_done() -> bool:
                snapshots.extend(redis_contents(client))
                return batch.done()

            wait_for(dump_until_done, timeout_s=60, what="the keyed batch", interval_s=0.01)
            snapshots.extend(redis_contents(client))
            outcomes = batch.outcomes(timeout=1)
            logs = worker_a.log.read_text() + worker_b.log.read_text()
    finally:
        recorder.stop()

    # Then the judge was called with the key (a missing key is a PermanentError, not "ok")
    for i, outcome in enumerate(outcomes):
        if i in failing:
            assert outcome.status == "error" and "server error 500" in outcome.error, outcome
            # a worker republished it to the sibling's queue before giving up
            assert "no sibling backend left" in outcome.error, outcome
        else:
            assert outcome.status == "ok", outcome
            assert outcome.score == expected_judge_score(app.qrq_config, outcome, samples[i])
    stats = judge.stats()
    assert stats["accepted"] == len(samples) - len(failing)
    assert stats["errors"] >= 1
    stored = [text for _, value in snapshots for text in with_message_bodies(value)]
    published = [text for _, data in recorder.messages for text in with_message_bodies(data)]
    # and the scan really saw task messages, results and task events, decoded
    assert any(b"secret question 0" in text for text in queued)
    # (outcomes reach the client on its inbox stream; a task's stored result is read and
    # deleted only when its outcomes were not all recorded)
    assert any(b"qrq:inbox:" in key for key, _ in snapshots)
    assert any(b"Score:" in text for text in stored)
    assert any(b"task-succeeded" in text for text in published)
    # but the key appears nowhere: not in any Redis key or value, event, result or log line
    secret = SECRET.encode()
    assert not [key for key, value in snapshots if secret in value or secret in key]
    assert not [text for text in stored + published if secret in text]
    assert SECRET not in logs
    assert "QRQ_TEST_KEY" not in os.environ  # the client side never had it
    client.close()


# --------------------------------------------------------------------------------------------
# A CPU reward function in a prefork pool


def test_function_backend_scores_chunks_and_isolates_bad_samples(tmp_path, redis_url):
    # Given a prefork worker for exact_match, 32 samples per task
    config_path = write_config(
        tmp_path,
        {"em": function_backend("qreward_queue.rewards.basic:exact_match", chunk_size=32)},
        redis_url=redis_url,
        fallback_score=FALLBACK,
    )
    app = make_app(config_path)
    samples = []
    for i in range(300):
        sample = {"prompt": f"{i} + 1 = ?", "response": f"It is {i + 1 if i % 3 else i}."}
        if i % 10 == 3:
            pass  # no reference at all
        elif i % 10 == 7:
            sample["reference"] = "no number here"
        else:
            sample["reference"] = f"#### {i + 1}"
        samples.append(sample)
    with Worker(config_path, "em") as worker:
        # When 300 samples are scored (10 tasks)
        batch = qreward_queue.submit_batch(samples, route="em", app=app, deadline_s=90)
        outcomes = batch.outcomes(timeout=60)
        assert tasks_received(worker) == 10  # one task per chunk of 32, not one per sample
        # and the client deletes the results it collected, once each task's end is announced
        # (the outcomes themselves may all be in before the last task ends)
        results = redis.Redis.from_url(redis_url)
        wait_for(lambda: not list(results.scan_iter("qrq:celery-task-meta-*")), 30,
                 "the client to delete the tasks' results")
        # Then bad samples are errors that say what is wrong, and the rest are scored
        for i, (sample, outcome) in enumerate(zip(samples, outcomes, strict=True)):
            if i % 10 == 3:
                assert outcome.status == "error", outcome
                assert "needs the sample's 'reference'" in outcome.error
                assert outcome.score == FALLBACK
            elif i % 10 == 7:
                assert outcome.status == "error", outcome
                assert "holds no number" in outcome.error
                assert outcome.score == FALLBACK
            else:
                assert outcome.status == "ok", outcome
                assert outcome.score == exact_match(sample)
                assert outcome.backend == "em"
        assert {o.score for o in outcomes if o.status == "ok"} == {0.0, 1.0}
        # and the worker survived and scores the next batch
        assert_worker_alive(worker)
        more = [s for s in samples_for(20) if s.get("reference")]
        again = qreward_queue.submit_batch(more, route="em", app=app, deadline_s=60)
        assert [o.status for o in again.outcomes(timeout=30)] == ["ok"] * len(more)
        assert again.get() == [exact_match(s) for s in more]
        assert_worker_alive(worker)


# --------------------------------------------------------------------------------------------
# A batch reward-model server


def test_reward_model_batches_and_isolates_a_rejected_item(tmp_path, redis_url, judge):
    # Given a reward-model backend on the mock judge's /v1/rewards, 8 items per call
    config_path = write_config(
        tmp_path,
        {"rm": reward_model_backend(judge.url, batch_size=8)},
        redis_url=redis_url,
        fallback_score=FALLBACK,
    )
    app = make_app(config_path)
    samples = samples_for(40, tag="rm")
    with Worker(config_path, "rm") as worker:
        # When 40 samples are scored
        outcomes = qreward_queue.submit_batch(samples, route="rm", app=app).outcomes(timeout=60)
        # Then every score is the reward model's, and they went in calls of 8
        assert [o.status for o in outcomes] == ["ok"] * 40
        assert [o.score for o in outcomes] == [
            rm_verdict(s["prompt"], s["response"]) for s in samples
        ]
        stats = judge.stats()
        assert (stats["requests"], stats["items"]) == (5, 40)

        # When one item of a 16-sample batch makes the server reject its whole call (400)
        judge.reset()
        bad = 5
        samples = samples_for(16, tag="rm-bad")
        samples[bad]["response"] += " [[mock:400]]"
        outcomes = qreward_queue.submit_batch(samples, route="rm", app=app).outcomes(timeout=60)
        # Then the call is split until only that sample errors; the others are scored
        for i, (sample, outcome) in enumerate(zip(samples, outcomes, strict=True)):
            if i == bad:
                assert outcome.status == "error", outcome
                assert "rejected with 400" in outcome.error
                assert "[[mock:400]]" in (outcome.detail or "")
                assert outcome.score == FALLBACK
            else:
                assert outcome.status == "ok", (i, outcome)
                assert outcome.score == rm_verdict(sample["prompt"], sample["response"])
        assert judge.stats()["items"] == 15
        assert_worker_alive(worker)


# --------------------------------------------------------------------------------------------
# Hostile judge replies


def test_hostile_replies_become_explicit_errors(tmp_path, redis_url, judge):
    # Given a judge backend with 3 attempts for retryable errors
    config_path = write_config(
        tmp_path, {"j": judge_backend(judge.url)}, redis_url=redis_url, fallback_score=FALLBACK
    )
    app = make_app(config_path)
    faults = {3: "garbage", 17: "garbage", 8: "badjson", 29: "badjson", 12: "500", 40: "500"}
    samples = samples_for(50, tag="hostile")
    for i, fault in faults.items():
        samples[i]["response"] += f" [[mock:{fault}]]"
    with Worker(config_path, "j") as worker:
        # When a batch of 50 holds replies without a score, broken JSON and persistent 500s
        batch = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=90)
        outcomes = batch.outcomes(timeout=60)
        # Then those come back as errors with the fallback score and a reason, never a score
        for i, outcome in enumerate(outcomes):
            fault = faults.get(i)
            if fault is None:
                assert outcome.status == "ok", (i, outcome)
                assert outcome.score == expected_judge_score(app.qrq_config, outcome, samples[i])
                continue
            assert outcome.status == "error", (i, outcome)
            assert outcome.score == FALLBACK
            if fault == "garbage":
                assert "no score in the judge's reply" in outcome.error
                assert outcome.detail == "I cannot decide."  # the reply, quoted
                assert outcome.attempts == 1  # unparseable: never retried blindly
            elif fault == "badjson":
                assert "not JSON" in outcome.error
                assert outcome.detail.startswith('{"id": "chatcmpl-broken"')
                assert outcome.attempts == 1
            else:
                assert "server error 500" in outcome.error
                assert outcome.attempts == 3  # retried, then given up explicitly
        stats = judge.stats()
        assert stats["errors"] == 2 * 3
        # and the worker is alive and scores another batch
        assert_worker_alive(worker)
        more = samples_for(10, tag="after")
        again = qreward_queue.submit_batch(more, route="j", app=app).outcomes(timeout=30)
        assert_scores_correct(app.qrq_config, more, again)
        assert_worker_alive(worker)
