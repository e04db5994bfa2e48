"""Chaos suite (issue 12): faults a real deployment meets, against real workers and Redis.

Each test reproduces one break found by a fault campaign and fails without its fix. Redis
restarts run on a PRIVATE redis-server (tests/support.py PrivateRedis), never the shared one.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import redis
from click.testing import CliRunner
from faults import FAULTS, SAMPLES, run_fault
from support import (
    PrivateRedis,
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
from qreward_queue.cli import cli
from qreward_queue.mock_judge import MockJudgeSettings, spawn

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
    # the pools dropped and the transport's client gone, the channel itself not yet closed
    from kombu import Connection, Queue

    import qreward_queue.app  # noqa: F401  (installs kombu_fix, as every qrq process does)

    with Connection(redis_url) as conn:
        channel = conn.default_channel
        queue = Queue("chaos.kombu", routing_key="chaos.kombu")(channel)
        queue.declare()
        conn.Producer(channel).publish({"n": 1}, routing_key="chaos.kombu", serializer="json")
        assert queue.get(no_ack=False).payload == {"n": 1}
        channel._disconnect_pools()
        conn.transport.client = None
        # When the channel closes (kombu 5.7.0 alone: AttributeError ... 'hostname')
        channel.close()
    # Then the unacked message is back on its queue, for the next worker
    assert redis.Redis.from_url(redis_url).llen("chaos.kombu") == 1


def test_a_channel_with_nothing_remembered_reports_a_connection_error(redis_url):
    # kombu and Celery treat redis.ConnectionError as "broker gone, reconnect"
    from kombu import Connection

    import qreward_queue.app  # noqa: F401

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


def test_malformed_task_messages_are_dead_lettered_and_the_worker_keeps_consuming(
    tmp_path, redis_url, redis_client, stack
):
    # Given one worker on a judge's queue
    judge = stack.enter_context(spawn(MockJudgeSettings(latency_ms=5)))
    config_path = write_config(tmp_path, {"j": judge_backend(judge.url)}, redis_url=redis_url)
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    (worker,) = start_workers(config_path, [("j", "poison@chaos")])
    stack.callback(worker.kill)
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
    from qreward_queue import dead_letter

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


class HostileServer:
    """A backend of the tests' own on 127.0.0.1: `respond(request_json, headers)` returns
    (status, content type, body text) for each POST, whatever the path; `extra_headers` are
    sent with every reply."""

    def __init__(self, respond):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer, self.extra_headers = self, {}

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, ctype, reply = respond(body, self.headers)
                data = reply.encode()
                self.send_response(status)
                for name, value in outer.extra_headers.items():
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
    bounded = app.limiter("j").status()["bounded"]
    assert bounded and "x-ratelimit-reset-requests" in bounded, bounded
