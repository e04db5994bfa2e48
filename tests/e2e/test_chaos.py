"""Chaos suite (issue 12): faults a real deployment meets, against real workers and Redis.

Each test reproduces one break found by a fault campaign and fails without its fix. Redis
restarts run on a PRIVATE redis-server (tests/support.py PrivateRedis), never the shared one.
"""

from __future__ import annotations

import itertools
import json
import threading
import time

import pytest
import redis
from click.testing import CliRunner
from faults import FAULTS, SAMPLES, run_fault
from support import (
    PrivateRedis,
    close_half_closed_channel,
    expected,
    judge_backend,
    redis_contents,
    start_workers,
    tasks_received,
    wait_for,
    with_message_bodies,
    write_config,
)

import qreward_queue
from qreward_queue.cli.main import cli
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn

FALLBACK = -1.0


def samples_for(n: int, tag: str) -> list[dict]:
    return [{"prompt": f"{tag} question {i}", "response": f"answer {i * 3}"} for i in range(n)]


def assert_all_right(app, backend: str, samples: list[dict], outcomes) -> None:
    for i, (sample, outcome) in enumerate(zip(samples, outcomes, strict=True)):
        assert outcome.status == "ok", (i, outcome)
        assert outcome.score == expected(app, backend, sample), (i, outcome)


def test_a_channel_closed_after_kombu_dropped_its_client_still_restores_unacked(redis_url):
    # Given a kombu Redis channel holding one unacknowledged message (as a worker does), in
    # the state a Redis restart leaves it in when Celery's Connection.collect() is cut short:
    # the pools dropped and the transport's client gone, the channel itself not yet closed;
    # When the channel closes (kombu 5.7.0 alone: AttributeError ... 'hostname')
    close_half_closed_channel(redis_url, "chaos.kombu")
    # Then the unacked message is back on its queue, for the next worker
    assert redis.Redis.from_url(redis_url).llen("chaos.kombu") == 1


def test_a_publish_through_a_channel_closed_under_it_goes_out_on_a_new_one(redis_url):
    """A task's retry published while the consumer's reconnect closed the producer's channel
    (kombu sets the channel's connection to None) is published again on a new channel, not
    dropped with an AttributeError (see kombu_fix)."""
    from kombu import Connection

    import qreward_queue.broker.app  # noqa: F401  (installs kombu_fix, as every qrq process does)

    with Connection(redis_url) as conn:
        producer = conn.Producer()  # on the connection's default channel, as Celery's are
        producer.channel.close()
        producer.publish({"n": 1}, routing_key="chaos.closed", serializer="json", retry=True)
    assert redis.Redis.from_url(redis_url).llen("chaos.closed") == 1


def test_a_channel_with_nothing_remembered_reports_a_connection_error(redis_url):
    # kombu and Celery treat redis.ConnectionError as "broker gone, reconnect"
    from kombu import Connection

    import qreward_queue.broker.app  # noqa: F401

    with Connection(redis_url) as conn:
        channel = conn.default_channel
        channel.__dict__["_qrq_connparams"] = {}
        conn.transport.client = None
        with pytest.raises(redis.ConnectionError, match="broker connection was closed"):
            channel._connparams()


@pytest.mark.slow
def test_workers_survive_three_redis_restarts_mid_batch(tmp_path, stack):
    # Given a private Redis without persistence, three workers and a judge at ~200 ms a call
    server = PrivateRedis(tmp_path).start()
    stack.callback(server.kill)
    judge = stack.enter_context(spawn(MockJudgeSettings(latency_ms=200, latency_cv=0.2)))
    config_path = write_config(
        tmp_path, {"j": judge_backend(judge.url, concurrency=4)},
        redis_url=server.url, fallback_score=FALLBACK,
    )
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    workers = start_workers(config_path, [("j", f"w{i}@chaos") for i in range(3)])
    for worker in workers:
        stack.callback(worker.kill)
    samples = samples_for(600, "restarts")  # ~10 s of judge time on 12 threads
    batch = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=150)
    # When Redis is SIGKILLed three times mid-batch (after 1/6, 2/6 and 3/6 of it), each time
    # back (empty) 3 s later
    for restart in range(3):
        target = (restart + 1) * len(samples) // 6
        try:
            wait_for(lambda t=target: batch.completed >= t, timeout_s=60, what="progress")
        except AssertionError:
            raise AssertionError(
                f"no progress before restart {restart}: {batch.completed} done, "
                f"{batch.resubmitted} resent, {len(batch._pending)} pending, Redis keys "
                f"{sorted(redis.Redis.from_url(server.url).keys())[:12]}"
            ) from None
        assert batch.completed < len(samples), "the batch finished before the restarts"
        server.kill()
        time.sleep(3)
        server.start()
    outcomes = batch.outcomes(timeout=140)
    # Then no sample is lost and every worker is alive...
    logs = "\n".join(w.log.read_text()[-3000:] for w in workers)
    assert all(w.proc.poll() is None for w in workers), logs
    assert "Unrecoverable error" not in logs, logs
    assert_all_right(app, "j", samples, outcomes)
    # ...and still consuming: a new batch reaches every one of them
    before = [tasks_received(w) for w in workers]
    more = samples_for(60, "after")
    batch = qreward_queue.submit_batch(more, route="j", app=app)
    assert_all_right(app, "j", more, batch.outcomes())
    after = [tasks_received(w) for w in workers]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_buys_at_most_1_percent_of_the_calls_twice_and_loses_nothing(fault, tmp_path):
    # Given 2,000 samples on three workers, when two workers are killed, Redis restarts
    # empty, or Redis freezes for 60 s, a quarter of the way in (tests/faults.py)
    figures = run_fault(fault, tmp_path)
    print(figures)
    # Then every sample is scored right, and the judge's own counter says that at most 1% of
    # its calls were bought twice (before this: 186, 384 and 960 in this setting, README)
    assert figures["lost"] == 0, figures
    assert figures["duplicates"] <= SAMPLES // 100, figures


POISON_BODIES = ["str", {"a": 1}, [[], {}], None]


def judge_and_worker(tmp_path, redis_url, stack, name: str):
    """A fast mock judge, its backend `j` and one worker `name` on its queue."""
    judge = stack.enter_context(spawn(MockJudgeSettings(latency_ms=5)))
    config_path = write_config(tmp_path, {"j": judge_backend(judge.url)}, redis_url=redis_url)
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    (worker,) = start_workers(config_path, [("j", name)])
    stack.callback(worker.kill)
    return config_path, app, worker


def test_malformed_task_messages_are_dead_lettered_and_the_worker_keeps_consuming(
    tmp_path, redis_url, redis_client, stack
):
    # Given one worker on a judge's queue
    config_path, app, worker = judge_and_worker(tmp_path, redis_url, stack, "poison@chaos")
    # When task messages with valid JSON bodies of the wrong shape arrive, published as any
    # kombu client could, with the headers of a real qrq task
    with app.connection_for_write() as conn:
        producer = conn.Producer(serializer="json")
        for i, body in enumerate(POISON_BODIES):
            producer.publish(
                body, routing_key="qrq.j", priority=0,
                headers={"task": "qrq.score_chunk", "id": f"poison-{i}", "lang": "py"},
            )
        producer.publish(  # and one that is not even JSON
            "{not json", routing_key="qrq.j", priority=0, serializer=None,
            content_type="application/json", headers={"task": "qrq.score_chunk", "id": "raw"},
        )
    wait_for(lambda: redis_client.llen("qrq:dead-letters") > len(POISON_BODIES), 20,
             "the malformed messages to be rejected")
    # Then a normal batch behind them is scored in full by the same, living worker
    samples = samples_for(12, "after-poison")
    outcomes = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=60).outcomes()
    assert worker.proc.poll() is None, worker.log.read_text()[-3000:]
    assert_all_right(app, "j", samples, outcomes)
    # and each bad message is kept once, inspectable, with the reason, and not requeued
    from qreward_queue.ops import dead_letter

    raw, *letters = dead_letter.read(redis_client)
    assert (raw["body"], raw["headers"]["id"]) == ("{not json", "raw")
    assert raw["reason"].startswith("undecodable task message"), raw
    assert {d["headers"]["id"] for d in letters} == {f"poison-{i}" for i in range(4)}
    assert all("malformed task message" in d["reason"] for d in letters), letters
    assert [json.loads(d["body"]) for d in reversed(letters)] == POISON_BODIES
    log = worker.log.read_text()
    assert log.count("Received invalid task message") == len(POISON_BODIES), log[-3000:]
    assert log.count("Can't decode message body") == 1, log[-3000:]
    assert "Unrecoverable error" not in log
    assert redis_client.llen("qrq:dead-letters") == len(POISON_BODIES) + 1
    shown = CliRunner().invoke(cli, ["dead-letters", "--config", str(config_path)])
    assert shown.exit_code == 0, shown.output
    assert [json.loads(line)["headers"]["id"] for line in shown.output.splitlines()] == [
        "raw", *(f"poison-{i}" for i in reversed(range(len(POISON_BODIES))))]


BAD_KWARGS = [
    {"backend": "j", "samples": "abc"},
    {"backend": "j", "samples": [1, 2, 3]},
    {"backend": "j", "samples": [{"prompt": "p", "response": "r"}], "batch": "b",
     "indices": [0, 1]},
    {"backend": "j", "samples": [{"prompt": "p", "response": "r"}], "attempt": "x"},
]


def test_a_task_message_breaking_the_chunk_contract_takes_nothing_and_is_dead_lettered(
    tmp_path, redis_url, redis_client, stack
):
    # Given one worker on a judge's queue
    _, app, worker = judge_and_worker(tmp_path, redis_url, stack, "kwargs@chaos")
    # When well-formed task messages whose kwargs break score_chunk's contract arrive, more
    # of them than the worker has call slots
    for _ in range(10):
        for kwargs in BAD_KWARGS:
            app.send_task("qrq.score_chunk", kwargs=kwargs, queue="qrq.j", priority=0)
    wait_for(lambda: redis_client.llen("qrq:dead-letters") >= 10 * len(BAD_KWARGS), 30,
             "the malformed messages to be dead-lettered")
    # Then each is kept with the field it breaks named, and the worker, alive, with all its
    # call slots, scores a normal batch behind them
    from qreward_queue.ops import dead_letter

    reasons = {d["reason"] for d in dead_letter.read(redis_client, 1000)}
    assert reasons == {
        "malformed task message: kwargs: samples must be a list of sample objects",
        "malformed task message: kwargs: indices must be a list of sample positions, one per "
        "sample",
        "malformed task message: kwargs: attempt must be a whole number >= 1",
    }, reasons
    samples = samples_for(64, "after-bad-kwargs")
    outcomes = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=60).outcomes()
    assert worker.proc.poll() is None, worker.log.read_text()[-3000:]
    assert_all_right(app, "j", samples, outcomes)


class HostileServer:
    """A backend of the tests' own on 127.0.0.1: `respond(request_json, headers)` returns
    (status, content type, body text[, reply headers]) for each POST, whatever the path;
    `extra_headers` are sent with every reply."""

    def __init__(self, respond):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer, self.extra_headers = self, {}

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, ctype, reply, *own = respond(body, self.headers)
                data = reply.encode()
                self.send_response(status)
                for name, value in {**outer.extra_headers, **(own or [{}])[0]}.items():
                    self.send_header(name, value)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def hostile(stack, respond) -> HostileServer:
    server = HostileServer(respond)
    stack.callback(server.close)
    return server


def chat_reply(content: str, total_tokens: int | str = 10) -> tuple[int, str, str]:
    """A 200 chat completion; `total_tokens` as text is pasted into the JSON as is."""
    reply = json.dumps({"choices": [{"message": {"content": content}}], "usage": "USAGE"})
    return 200, "application/json", reply.replace('"USAGE"', f'{{"total_tokens": {total_tokens}}}')


def echo_the_key(body: dict, headers) -> tuple[int, str, str]:
    """By prompt: `mode:401` (OpenAI-style partial quote plus the raw header), `mode:500`
    (the raw header in a plain-text error) or else the key inside a valid verdict."""
    auth = headers.get("Authorization", "")
    key = auth.removeprefix("Bearer ")
    prompt = body["messages"][-1]["content"]
    if "mode:401" in prompt:
        message = f"Incorrect API key provided: {key[:8]}****{key[-4:]}; you sent {auth}"
        return 401, "application/json", json.dumps({"error": {"message": message}})
    if "mode:500" in prompt:
        return 500, "text/plain", f"proxy failed; headers: {auth}"
    return chat_reply(f"key {key} ok. Score: 0.5")


def test_an_api_key_echoed_by_the_backend_is_stored_nowhere(
    tmp_path, redis_url, redis_client, stack
):
    # Given a judge that quotes the API key it receives in 401, 500 and 200 replies
    key = "qrq-test-" + "Zq81xLmP4vTr6NbK2" * 3
    echo = hostile(stack, echo_the_key)
    backend = judge_backend(echo.url, api_key_env="CHAOS_JUDGE_KEY")
    backend["retry"].update(attempts=2)
    config_path = write_config(tmp_path, {"j": backend}, redis_url=redis_url)
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    (worker,) = start_workers(config_path, [("j", "echo@chaos", {"CHAOS_JUDGE_KEY": key})])
    stack.callback(worker.kill)
    # When samples of every kind are scored
    modes = ["401", "500", "200"]
    samples = [{"prompt": f"mode:{m} #{i}", "response": "r"} for m in modes for i in range(2)]
    outcomes = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=60).outcomes()
    # Then the replies are reported (errors for 401/500, the verdict for 200)...
    assert [o.status for o in outcomes] == ["error"] * 4 + ["ok"] * 2, outcomes
    assert "401" in outcomes[0].error and "500" in outcomes[2].error, outcomes
    assert [o.score for o in outcomes[4:]] == [0.5, 0.5]
    assert all("[REDACTED]" in (o.detail or "") for o in outcomes), outcomes
    # ...but neither the key nor any long part of it is in an outcome, in Redis, or in the log
    leaks = [key, key[:12], key[-12:], key[20:30]]
    for outcome in outcomes:
        assert not any(leak in repr(outcome) for leak in leaks), outcome
    stored = [v for _, value in redis_contents(redis_client) for v in with_message_bodies(value)]
    assert stored, "nothing was stored in Redis"
    for value in stored:
        assert not any(leak.encode() in value for leak in leaks), value[:300]
    log = worker.log.read_text()
    assert "succeeded" in log and not any(leak in log for leak in leaks), log[-3000:]


VERDICTS = {  # what the judge says -> how qrq must report it
    "Score: 1e309": "score '1e309' is not a finite number",
    "Score: -5": "score '-5' is outside score_range [0, 1]",
    "Score: 0.2. On reflection, Score: 0.9": "2 different scores in the judge's reply",
    "Score: 1.5": "score '1.5' is outside score_range [0, 1]",
    "Score: 0.7. Again: Score: 0.7": None,
    "Score: 0.25": None,
}


def test_out_of_range_non_finite_and_ambiguous_scores_are_errors_quoting_the_reply(
    tmp_path, redis_url, stack
):
    # Given a judge that answers each prompt with the verdict the prompt names, on a backend
    # whose (default) prompt asks for a score from 0 to 1
    judge = hostile(stack, lambda body, _: chat_reply(
        body["messages"][-1]["content"].split("say<")[1].split(">")[0]))
    config_path = write_config(tmp_path, {"j": judge_backend(judge.url)}, redis_url=redis_url)
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    (worker,) = start_workers(config_path, [("j", "scores@chaos")])
    stack.callback(worker.kill)
    # When every verdict is scored
    samples = [{"prompt": f"say<{v}>", "response": "r"} for v in VERDICTS]
    outcomes = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=60).outcomes()
    # Then the wrong ones are errors that say why and quote the reply, the right ones are ok
    for (verdict, why), outcome in zip(VERDICTS.items(), outcomes, strict=True):
        if why is None:
            assert outcome.status == "ok" and outcome.score == float(verdict[-4:]), outcome
        else:
            assert outcome.status == "error" and why in outcome.error, (verdict, outcome)
            assert verdict in outcome.detail, outcome
    assert worker.proc.poll() is None


HUGE = "9" * 400


def test_huge_numbers_fail_only_their_own_item(tmp_path, redis_url, stack):
    # Given a reward model that gives one item of each call a 400-digit score and reports a
    # 400-digit token count, and a judge that reports a 400-digit token count
    def reward_model(body, _):
        scores = ["0.5" if "huge" not in it["prompt"] else HUGE for it in body["items"]]
        return 200, "application/json", (
            f'{{"scores": [{", ".join(scores)}], "usage": {{"total_tokens": {HUGE}}}}}')

    rm = hostile(stack, reward_model)
    judge = hostile(stack, lambda body, _: chat_reply("Score: 0.5", total_tokens=HUGE))
    config_path = write_config(tmp_path, {
        "rm": {"backend": {"kind": "reward_model", "url": rm.url, "batch_size": 8},
               "limits": {"tpm": 10_000_000}, "retry": {"attempts": 1}},
        "j": judge_backend(judge.url, max_concurrent=8),
    }, redis_url=redis_url)
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    workers = start_workers(config_path, [("rm", "rm@chaos"), ("j", "j@chaos")])
    for worker in workers:
        stack.callback(worker.kill)
    # When a chunk of 8 with one huge score, and judge samples, are scored
    samples = [{"prompt": f"{'huge' if i == 3 else 'fine'} {i}", "response": "r"} for i in range(8)]
    rm_outcomes = qreward_queue.submit_batch(samples, route="rm", app=app, deadline_s=60).outcomes()
    judged = qreward_queue.submit_batch(samples[:4], route="j", app=app, deadline_s=60).outcomes()
    # Then only the huge item is an error, with a clear message; the other 7 are scored
    assert [o.status for o in rm_outcomes] == ["ok"] * 3 + ["error"] + ["ok"] * 4, rm_outcomes
    assert "scores[3] is too large for a float" in rm_outcomes[3].error, rm_outcomes[3]
    assert {o.score for i, o in enumerate(rm_outcomes) if i != 3} == {0.5}
    # and a garbage token count only means "usage unknown": the judge's verdicts stand
    assert [(o.status, o.score) for o in judged] == [("ok", 0.5)] * 4, judged
    assert all(w.proc.poll() is None for w in workers)


def test_flower_port_is_private_in_compose_and_kubernetes():
    # Flower answers /metrics and /healthcheck without credentials, so no deployment file
    # may publish its port beyond the host (compose) or the cluster (Kubernetes)
    import yaml
    from support import ROOT

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    ports = [str(p) for p in compose["flower"].get("ports", [])]
    assert ports and all(p.startswith("127.0.0.1:") for p in ports), ports
    docs = [d for f in sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
            for d in yaml.safe_load_all(f.read_text()) if d]
    flower = [d for d in docs if "flower" in d["metadata"]["name"]]
    kinds = {d["kind"] for d in flower}
    assert {"Deployment", "Service", "NetworkPolicy"} <= kinds, kinds
    assert not any(d["kind"] == "Ingress" for d in docs)
    for service in (d for d in docs if d["kind"] == "Service"):
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP", service
        assert not any("nodePort" in p for p in service["spec"]["ports"]), service
    (policy,) = (d for d in flower if d["kind"] == "NetworkPolicy")
    assert policy["spec"]["ingress"][0]["from"], "the policy must name who may connect"


def test_rate_limit_headers_of_a_hostile_backend_cannot_stop_it(tmp_path, redis_url, stack):
    # Given a judge under a global limiter whose every reply claims a limit of 0 requests and
    # a reset 1e308 seconds away (before: a learned rate of 0, OverflowError in every task,
    # and an expiry Redis refuses)
    judge = hostile(stack, lambda body, _: chat_reply("Score: 0.5"))
    judge.extra_headers = {"x-ratelimit-limit-requests": "0", "x-ratelimit-reset-requests": "1e308",
                           "x-ratelimit-limit-tokens": "-1", "x-ratelimit-reset-tokens": "junk"}
    config_path = write_config(tmp_path, {"j": judge_backend(judge.url, rpm=6000)},
                               redis_url=redis_url)
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    (worker,) = start_workers(config_path, [("j", "headers@chaos")])
    stack.callback(worker.kill)
    # When two batches are scored one after the other
    samples = samples_for(20, "headers")
    first = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=60).outcomes()
    second = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=60).outcomes()
    # Then every sample of both is scored: the bad values were ignored or bounded
    assert [(o.status, o.score) for o in first + second] == [("ok", 0.5)] * 40, first + second
    # and what was bounded shows in `qrq status` for a while
    bounded = app.flow.limiter("j").status()["bounded"]
    assert bounded and "x-ratelimit-reset-requests" in bounded, bounded


WRONG_HEADERS = {  # every header Celery's worker reads before the task runs -> wrong values
    "id": [5, None, [], {"a": 1}],
    "task": [5, None, [], {"a": 1}],
    "timelimit": [[1, 2, 3], 5, "abc", [None], ["x", 1], [-1, 1], {"a": 1}, [True, 1]],
    "eta": ["abc", 5, [1], {"a": 1}, "9999-99-99T00:00:00", ""],
    "expires": ["abc", 5, [1], {"a": 1}, "2026-13-01T00:00:00", ""],
    "retries": ["abc", -1, 1.5, None, [], True],
    **{name: [5, [], {"a": 1}, True] for name in (
        "lang", "shadow", "root_id", "parent_id", "group", "argsrepr", "kwargsrepr", "origin")},
    "ignore_result": ["yes", 5, []],
    "stamped_headers": [5, "abc", [[1]], {"a": 1}],
    "stamps": [5, "abc", [1]],
    "replaced_task_nesting": ["x", -1, None],
    "groups": [5, "x", [1]],
    "group_index": ["x", -1, []],
}


def test_every_header_celery_reads_is_checked_and_a_wrong_one_is_dead_lettered(
    tmp_path, redis_url, redis_client, stack
):
    # Given one worker on a judge's queue, and the headers and body of a real qrq task
    _, app, worker = judge_and_worker(tmp_path, redis_url, stack, "headers@chaos")
    body = [[], {"backend": "j", "samples": samples_for(1, "bad-header"), "route": ["j"],
                 "deadline": time.time() + 600}, None]
    good = app.amqp.as_task_v2("x", "qrq.score_chunk", countdown=1, expires=600,
                               timelimit=(30, 20)).headers
    sent = 0
    for name, values in WRONG_HEADERS.items():
        # When, for each header, messages carrying each wrong value arrive (the rest valid)
        with app.connection_for_write() as conn:
            producer = conn.Producer(serializer="json")
            for k, value in enumerate(values):
                headers = {**good, "id": f"bad-{name}-{k}", "case": [name, k], name: value}
                producer.publish(body, routing_key="qrq.j", priority=0, headers=headers)
                sent += 1
        # Then each is dead-lettered and the same worker is alive and scoring right after
        wait_for(lambda n=sent: redis_client.llen("qrq:dead-letters") >= n, 20,
                 f"the messages with a wrong {name!r} header to be rejected")
        samples = samples_for(2, f"after-{name}")
        outcomes = qreward_queue.submit_batch(samples, route="j", app=app, priority="val",
                                              deadline_s=30).outcomes()
        assert worker.proc.poll() is None, (name, worker.log.read_text()[-3000:])
        assert_all_right(app, "j", samples, outcomes)
    from qreward_queue.ops import dead_letter

    letters = dead_letter.read(redis_client, limit=sent + 1)
    assert len(letters) == sent, [d["reason"] for d in letters]
    for letter in letters:  # each kept once, with a reason naming the wrong header
        name, k = letter["headers"]["case"]
        assert letter["headers"][name] == WRONG_HEADERS[name][k], letter
        assert "malformed task message" in letter["reason"] and name in letter["reason"], letter
    assert "Unrecoverable error" not in worker.log.read_text()


def test_the_headers_celery_itself_sends_pass_the_checks():
    # what a qrq client sends, and what a retry with a countdown (an eta) or limits carries
    from celery import Celery

    from qreward_queue.ops.dead_letter import header_problem

    amqp = Celery(set_as_current=False).amqp
    sent = [amqp.as_task_v2("t1", "qrq.score_chunk", kwargs={"x": 1}, expires=30.5,
                            argsrepr="('j', <1 samples>)", kwargsrepr="{}").headers,
            amqp.as_task_v2("t2", "qrq.score_chunk", countdown=2.5, retries=3, root_id="t1",
                            parent_id="t1", timelimit=(None, 20), group_id="g",
                            group_index=0, ignore_result=True, stamped_headers=["s"],
                            s="v", shadow="name").headers]
    assert [header_problem(json.loads(json.dumps(h))) for h in sent] == [None, None]


def test_429s_without_a_usable_retry_after_cost_only_their_own_samples(
    tmp_path, redis_url, stack
):
    # Given a judge under a global limiter that answers two prompts with 429 and a Retry-After
    # it cannot use, and the rest with a verdict
    tries: dict[str, int] = {}

    def respond(body, _):
        prompt = body["messages"][-1]["content"]
        tries[prompt] = tries.get(prompt, 0) + 1
        if "throttle<" in prompt:
            retry_after = prompt.split("throttle<")[1].split(">")[0]
            return 429, "application/json", json.dumps({"error": {"message": "slow down"}}), {
                "Retry-After": retry_after}
        return chat_reply("Score: 0.5")

    server = hostile(stack, respond)
    backend = judge_backend(server.url, rpm=60_000, calls=4)
    backend["retry"].update(attempts=3, backoff_base_s=0.2, backoff_cap_s=1.0)
    config_path = write_config(tmp_path, {"j": backend}, redis_url=redis_url)
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    (worker,) = start_workers(config_path, [("j", "throttled@chaos")])
    stack.callback(worker.kill)
    # When a batch of 22 holds two such samples among 20 innocent ones (in the same chunks)
    samples = samples_for(22, "innocent")
    samples[3]["prompt"] = "throttle<-5>"
    samples[17]["prompt"] = "throttle<soon-ish>"
    batch = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=60)
    limiter, pauses = app.flow.limiter("j"), []
    while not batch.done():  # a pause is in force for its whole length: a poll sees it
        pauses.append(limiter.status()["paused_for_s"])
        time.sleep(0.02)
    outcomes = batch.outcomes()
    # Then the two are errors after at most their 3 attempts each, sent at most 3 times...
    bad = [outcomes[3], outcomes[17]]
    assert [o.status for o in bad] == ["error", "error"], bad
    assert all("429" in o.error and o.attempts <= 3 for o in bad), bad
    rendered = [p for p in tries if "throttle<" in p]
    assert len(rendered) == 2 and all(tries[p] <= 3 for p in rendered), tries
    # ...and the 20 innocent samples are scored, without waiting on them: no backend pause
    assert all(o.status == "ok" for i, o in enumerate(outcomes) if i not in (3, 17)), outcomes
    assert max(pauses, default=0.0) == 0.0 == limiter.status()["paused_for_s"], pauses


def test_one_reply_claiming_a_tiny_limit_does_not_throttle_the_backend(
    tmp_path, redis_url, stack
):
    # Given a judge under a global limiter of 6,000 rpm whose first reply claims a limit of
    # 1 request a minute (before: every worker believed it for 10 minutes)
    replies = itertools.count()

    def respond(body, _):
        first = next(replies) == 0
        return (*chat_reply("Score: 0.5"), {"x-ratelimit-limit-requests": "1"} if first else {})

    judge = hostile(stack, respond)
    config_path = write_config(tmp_path, {"j": judge_backend(judge.url, rpm=6000)},
                               redis_url=redis_url)
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    (worker,) = start_workers(config_path, [("j", "tiny-limit@chaos")])
    stack.callback(worker.kill)
    first = qreward_queue.submit_batch(samples_for(1, "first"), route="j", app=app,
                                       deadline_s=30).outcomes()
    assert first[0].status == "ok", first
    # When the next 20 samples are scored
    samples = samples_for(20, "next")
    batch = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=30)
    outcomes = batch.outcomes()
    # Then all are scored at the configured rate: one reply's word was not believed...
    assert [(o.status, o.score) for o in outcomes] == [("ok", 0.5)] * 20, outcomes
    rpm = app.flow.limiter("j").status()["limits"]["rpm"]
    assert rpm["per_minute"] == 6000 and rpm["learned"]["believed"] is False, rpm
    # ...and `qrq status` shows what was told, and why it was not believed
    shown = CliRunner().invoke(cli, ["status", "--config", str(config_path)])
    assert shown.exit_code == 0, shown.output
    assert "j: rpm limit 1/min told (1 reply(s), last" in shown.output, shown.output
    assert "not believed: it takes 3 agreeing replies within 60 s" in shown.output, shown.output
