"""Hardening of the call and the client (issue 12, items 3, 5, 7, 10, 12): a trickling reply
ends at the call's time limit, redirects are never followed, retried tasks carry no prompt in
their headers, the deadline holds when Redis freezes, and a Redis outage at submit is one
error type naming the URL without its password."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import threading
import time

import pytest
import redis
from support import PrivateRedis, Worker, free_port, judge_backend, wait_for, write_config

import qreward_queue
from qreward_queue.backends import JudgeOptions
from qreward_queue.backends.transport import post_json, post_json_async
from qreward_queue.config.model import Backend
from qreward_queue.errors import PermanentError, RedisUnreachable, TransientError
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn
from qreward_queue.worker.call_loop import call_loop


@pytest.fixture(params=["pool thread", "call loop"])
def post(request):
    """The transport as a call pool's thread uses it, and as the worker's call loop does."""
    if request.param == "pool thread":
        return post_json
    return lambda config, url, payload: call_loop().run(post_json_async(config, url, payload),
                                                        None)


class RawServer:
    """A TCP server of the test's own that answers every connection with `reply(conn)`."""

    def __init__(self, reply):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.reply = reply
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            conn.recv(65536)
            self.reply(conn)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.sock.close()


def judge(url: str, timeout_s: float = 2.0) -> Backend:
    return Backend(name="hostile", kind="judge", timeout_s=timeout_s, options=JudgeOptions(url=url,
                   model="m"))


def test_a_trickling_reply_ends_at_the_calls_total_time_limit(post):
    stop = threading.Event()

    def trickle(conn: socket.socket) -> None:  # valid headers, then a byte a second
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n")
        while not stop.wait(1.0):
            conn.sendall(b" ")

    server = RawServer(trickle)
    try:
        started = time.monotonic()
        with pytest.raises(TransientError) as caught:
            post(judge(f"http://127.0.0.1:{server.port}/v1"),
                      f"http://127.0.0.1:{server.port}/v1/chat/completions", {"x": 1})
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        server.close()
    # each read got a byte in time, yet the call as a whole ended at its 2 s limit
    assert caught.value.timed_out and "within 2 s" in str(caught.value)
    assert elapsed < 2.0 + 1.5, elapsed  # deadline promise: a call's total time limit


OK_REPLY = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 8\r\n\r\n"
            b'{"x": 1}')


def calls_to(post, server: RawServer, n: int) -> int:
    """Make `n` calls to `server` one after another, check each reply; the connections used."""
    url = f"http://127.0.0.1:{server.port}/v1"
    try:
        replies = [post(judge(url), f"{url}/chat/completions", {"x": 1}) for _ in range(n)]
    finally:
        server.close()
    assert [r.body for r in replies] == [{"x": 1}] * n
    return server.connections


def test_calls_from_one_thread_share_one_kept_alive_connection(post):
    def answer_every_request(conn: socket.socket) -> None:
        conn.sendall(OK_REPLY)
        while conn.recv(65536):
            conn.sendall(OK_REPLY)

    assert calls_to(post, RawServer(answer_every_request), 5) == 1  # connection for 5 calls


def test_a_kept_alive_connection_the_server_closed_while_idle_is_replaced(post):
    server = RawServer(lambda conn: conn.sendall(OK_REPLY))  # then closes, saying nothing
    assert calls_to(post, server, 3) == 3


def test_a_kept_alive_connection_closed_as_the_request_arrives_is_retried_once_fresh(post):
    def answer_one_then_drop_the_next(conn: socket.socket) -> None:
        conn.sendall(OK_REPLY)
        conn.recv(65536)  # the second request on this connection: closed unanswered

    server = RawServer(answer_one_then_drop_the_next)
    url = f"http://127.0.0.1:{server.port}/v1"
    try:
        first = post(judge(url), f"{url}/chat/completions", {"x": 1})
        time.sleep(0.2)  # the connection is idle and still open when the second call starts
        second = post(judge(url), f"{url}/chat/completions", {"x": 2})
    finally:
        server.close()
    assert first.body == second.body == {"x": 1}
    assert server.connections == 2


def test_a_fresh_connection_closed_unanswered_is_a_transient_error_not_a_retry(post):
    server = RawServer(lambda conn: None)  # reads the request, closes without a word
    url = f"http://127.0.0.1:{server.port}/v1"
    try:
        with pytest.raises(TransientError) as caught:
            post(judge(url), f"{url}/chat/completions", {"x": 1})
    finally:
        server.close()
    assert f"connection to {url}/chat/completions failed: RemoteDisconnected" in str(caught.value)
    assert server.connections == 1


def test_an_api_key_with_a_line_break_is_refused_before_anything_is_sent(post, monkeypatch):
    server = RawServer(lambda conn: conn.sendall(OK_REPLY))
    url = f"http://127.0.0.1:{server.port}/v1"
    monkeypatch.setenv("QRQ_TEST_INJECTED_KEY", "sk-1\r\nX-Evil: 1")
    backend = Backend(name="keyed", kind="judge", timeout_s=2, api_key_env="QRQ_TEST_INJECTED_KEY",
                      options=JudgeOptions(url=url, model="m"))
    try:
        with pytest.raises(PermanentError) as caught:
            post(backend, f"{url}/chat/completions", {"x": 1})
    finally:
        server.close()
    assert "QRQ_TEST_INJECTED_KEY" in str(caught.value) and "line break" in str(caught.value)
    assert "sk-1" not in str(caught.value) and server.connections == 0


@pytest.mark.parametrize("code", [301, 302, 307, 308])
def test_a_redirect_is_an_error_naming_where_it_pointed_and_is_not_followed(post, code):
    elsewhere = RawServer(lambda conn: conn.sendall(b"HTTP/1.1 200 OK\r\n\r\n"))
    target = f"http://user:pw@127.0.0.1:{elsewhere.port}/steal"
    server = RawServer(lambda conn: conn.sendall(
        f"HTTP/1.1 {code} Moved\r\nLocation: {target}\r\nContent-Length: 0\r\n\r\n".encode()))
    try:
        with pytest.raises(PermanentError) as caught:
            post(judge(f"http://127.0.0.1:{server.port}/v1"),
                      f"http://127.0.0.1:{server.port}/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "the prompt"}]})
    finally:
        server.close()
        elsewhere.close()
    message = str(caught.value)
    assert f"redirected ({code}) to http://127.0.0.1:{elsewhere.port}/steal" in message
    assert "pw" not in message
    assert elsewhere.connections == 0  # nothing, prompt included, went to the other host


def test_submit_with_redis_down_raises_one_error_type_naming_the_url(tmp_path):
    url = f"redis://:hunter2secret@127.0.0.1:{free_port()}/0"
    config = write_config(tmp_path, {"j": judge_backend("http://127.0.0.1:9")}, redis_url=url)
    app = qreward_queue.configure(config)
    for route_kwargs in ({"route": "j"}, {"route": "j", "priority": "val"}):
        with pytest.raises(RedisUnreachable) as caught:
            qreward_queue.submit_batch([{"prompt": "p", "response": "r"}], app=app,
                                       **route_kwargs)
        message = str(caught.value)
        assert f"127.0.0.1:{url.rsplit(':', 1)[1].split('/')[0]}" in message
        assert "hunter2secret" not in message and "\n" not in message


def test_retried_tasks_show_a_summary_not_the_prompt(tmp_path, redis_url):
    # Given a judge that is down, and a retry backoff long enough to look at the message
    backend = judge_backend(f"http://127.0.0.1:{free_port()}")
    backend["retry"] = {"attempts": 3, "backoff_base_s": 30, "jitter": False}
    config = write_config(tmp_path, {"down": backend}, redis_url=redis_url)
    app = qreward_queue.configure(config)
    store = redis.Redis.from_url(redis_url)
    with Worker(config, "down"):
        qreward_queue.submit_batch([{"prompt": "TOP-SECRET-PROMPT", "response": "r"}],
                                   route="down", app=app, deadline_s=120)

        def retried() -> list[dict]:  # the retry waits out its countdown, unacked, in Redis
            found = []
            for raw in store.hvals("qrq:unacked"):
                payload = json.loads(raw)[0]  # [message, exchange, routing key]
                if payload["headers"].get("retries"):
                    found.append(payload)
            return found

        (message,) = wait_for(retried, timeout_s=30, what="the retried task message")
    headers = message["headers"]
    assert headers["argsrepr"] == "('down', <1 samples>)" and headers["kwargsrepr"] == "{}"
    assert "TOP-SECRET-PROMPT" not in json.dumps(headers)
    assert "TOP-SECRET-PROMPT" in base64.b64decode(message["body"]).decode()  # the task's own
    store.close()


def frozen_or_down_redis_setup(tmp_path, stack, samples: int):
    """A private Redis, a judge at 200 ms a call, one worker making 2 calls at once (about
    10 samples/s), and `samples` samples to score."""
    private = PrivateRedis(tmp_path).start()
    stack.callback(private.kill)
    judge_proc = stack.enter_context(spawn(MockJudgeSettings(latency_ms=200, latency_cv=0)))
    config = write_config(tmp_path, {"j": judge_backend(judge_proc.url, calls=2)},
                          redis_url=private.url)
    app = qreward_queue.configure(config)
    worker = stack.enter_context(Worker(config, "j"))
    return private, app, worker, [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(samples)]


@pytest.mark.slow
def test_the_deadline_holds_when_redis_freezes(tmp_path, stack):
    # Given a batch with a 20 s deadline that needs about 30 s
    private, app, worker, samples = frozen_or_down_redis_setup(tmp_path, stack, 300)
    batch = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=20)
    wait_for(lambda: batch.completed > 0, timeout_s=30, what="the first results")
    time.sleep(max(0.0, batch.deadline - 16 - time.time()))
    # When Redis stops answering (SIGSTOP) 4 s into it
    os.kill(private.proc.pid, signal.SIGSTOP)
    stack.callback(lambda: os.kill(private.proc.pid, signal.SIGCONT))
    outcomes = batch.outcomes()
    late_by = time.time() - batch.deadline
    # Then outcomes() returns by the deadline (every wait on Redis, retries included, is
    # bounded by the time left), with what came back and the rest as timeouts
    assert late_by <= 1.0, late_by  # deadline promise: the batch deadline
    assert {o.status for o in outcomes} <= {"ok", "timeout"}
    assert sum(o.status == "timeout" for o in outcomes) > 0
    os.kill(private.proc.pid, signal.SIGCONT)
    worker.stop()


@pytest.mark.slow
def test_a_redis_outage_is_reported_as_one_not_as_a_missing_worker(tmp_path, stack, caplog):
    # Given a batch being scored by a live worker
    private, app, worker, samples = frozen_or_down_redis_setup(tmp_path, stack, 60)
    caplog.set_level("WARNING", logger="qreward_queue")
    batch = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=60)
    wait_for(lambda: batch.completed > 0, timeout_s=30, what="the first results")
    # When Redis is down for 8 s (killed, then back, empty)
    private.kill()
    down_at = time.time()
    threading.Timer(8, private.start).start()
    outcomes = batch.outcomes()
    # Then the client said Redis was unreachable since when, and that it retries until the
    # deadline; never that no live worker consumes the queue
    said = [r.getMessage() for r in caplog.records if r.name == "qreward_queue"]
    port = private.url.rsplit(":", 1)[1].split("/")[0]
    unreachable = [m for m in said if f"127.0.0.1:{port}/0 unreachable since" in m]
    assert unreachable and "retrying until the batch deadline" in unreachable[0], said
    near = {time.strftime("%H:%M:%S", time.localtime(down_at + d)) for d in (-1, 0, 1)}
    assert unreachable[0].split("since ")[1][:8] in near, (near, unreachable)
    assert any("answers again" in m for m in said), said
    # (another test's batch still waiting in this process may warn of its own queue)
    assert not any("no live worker" in m and str(tmp_path) in m for m in said), said
    # and the batch is scored in full once Redis is back
    assert [o.status for o in outcomes] == ["ok"] * len(samples), outcomes
    worker.stop()
