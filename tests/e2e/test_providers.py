"""Every judge a user has: auth schemes, headers, query parameters, dialects (OpenAI, Anthropic,
Azure), TLS with a private CA, proxies with CONNECT tunnels, and the call's priority sent to a
server that schedules by it. All against real servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from support import backend_of, expected, judge_backend, start_workers, toml_tables, write_config

import qreward_queue
from qreward_queue.backends import make_backend, transport
from qreward_queue.backends.dialects import DIALECTS
from qreward_queue.config.loader import load_backend
from qreward_queue.config.model import Backend
from qreward_queue.errors import ConfigError, PermanentError, RateLimited, TransientError
from qreward_queue.testing.certs import make_certs
from qreward_queue.testing.connect_proxy import ConnectProxy
from qreward_queue.testing.mock_judge import MockJudge, MockJudgeSettings, spawn, verdict

SAMPLE = {"prompt": "What is 2+2?", "response": "4"}
PROXY_ENV = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy",
             "ALL_PROXY", "all_proxy", "SSL_CERT_FILE")


def forget_sockets() -> None:
    transport._local.forget()
    transport._idle.forget()


@pytest.fixture(autouse=True)
def fresh_transport(monkeypatch):
    """No proxy or CA from the machine's environment; servers and sockets looked up anew."""
    for name in PROXY_ENV:
        monkeypatch.delenv(name, raising=False)
    for cached in (transport._server, transport._tls):
        cached.cache_clear()
    forget_sockets()
    yield
    for cached in (transport._server, transport._tls):
        cached.cache_clear()
    forget_sockets()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("ca"))


@pytest.fixture
def tls_judge(certs):
    settings = MockJudgeSettings(latency_ms=1, tls_cert=str(certs.cert), tls_key=str(certs.key))
    with MockJudge(settings) as judge:
        yield judge


@pytest.fixture
def plain_judge():
    with MockJudge(MockJudgeSettings(latency_ms=1)) as judge:
        yield judge


@pytest.fixture
def proxy():
    with ConnectProxy() as p:
        yield p


def judge_config(url: str, **fields) -> Backend:
    return backend_of("judge", name="j", url=url + "/v1", model="mock", timeout_s=10, **fields)


def score_both_ways(config: Backend) -> list[float]:
    """The sample's score through the sync path and through the call loop's."""
    client = make_backend(config)
    sync = client.call([SAMPLE]).scores[0]
    on_loop = asyncio.run(client.call_async([SAMPLE])).scores[0]
    return [sync, on_loop]


def failures_both_ways(config: Backend) -> list[str]:
    """The error each path meets, as its one-line message."""
    client, found = make_backend(config), []
    for call in (lambda: client.call([SAMPLE]), lambda: asyncio.run(client.call_async([SAMPLE]))):
        with pytest.raises(TransientError) as caught:
            call()
        found.append(str(caught.value))
    return found


def expected_score(config: Backend) -> float:
    return verdict(make_backend(config).render(SAMPLE))


# --- TLS ------------------------------------------------------------------------------------


def test_a_tls_judge_with_a_private_ca_is_trusted_by_ca_file_and_refused_without(
    tls_judge, certs
):
    # Given a judge serving HTTPS with a certificate from a throwaway CA
    trusted = judge_config(tls_judge.url, ca_file=str(certs.ca))
    # When it is called with the CA as ca_file, then both paths score through TLS
    assert score_both_ways(trusted) == [expected_score(trusted)] * 2
    # When it is called without, then each path refuses it in one clear line
    for message in failures_both_ways(judge_config(tls_judge.url)):
        assert "\n" not in message
        assert message.startswith(f"connection to {tls_judge.url}/v1/chat/completions failed: "
                                  "its TLS certificate is not trusted ("), message
        assert message.endswith("set ca_file in the backend file (or SSL_CERT_FILE) to the CA "
                                "that signed it"), message


def test_ssl_cert_file_trusts_a_private_ca(tls_judge, certs, monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", str(certs.ca))
    config = judge_config(tls_judge.url)
    assert score_both_ways(config) == [expected_score(config)] * 2


def test_verify_false_checks_no_certificate(tls_judge):
    config = judge_config(tls_judge.url, verify=False)
    assert score_both_ways(config) == [expected_score(config)] * 2


# --- proxies --------------------------------------------------------------------------------


def test_https_proxy_carries_tls_in_connect_tunnels_and_no_proxy_bypasses_it(
    tls_judge, certs, proxy, monkeypatch
):
    # Given HTTPS_PROXY naming a forward proxy
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)
    config = judge_config(tls_judge.url, ca_file=str(certs.ca))
    # When a call goes on each path, then each opens one tunnel, TLS with the judge inside
    assert score_both_ways(config) == [expected_score(config)] * 2
    assert proxy.counts == {"tunnels": 2, "forwards": 0, "refused": 0}
    # When NO_PROXY names the judge's host, then calls go straight to it
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    transport._server.cache_clear()
    forget_sockets()
    assert score_both_ways(config) == [expected_score(config)] * 2
    assert proxy.counts["tunnels"] == 2


def test_http_proxy_relays_plain_http_and_a_backend_proxy_overrides_the_environment(
    plain_judge, proxy, monkeypatch
):
    # Given HTTP_PROXY naming the proxy, then both paths reach a plain-HTTP judge through it
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    config = judge_config(plain_judge.url)
    assert score_both_ways(config) == [expected_score(config)] * 2
    assert proxy.counts == {"tunnels": 0, "forwards": 2, "refused": 0}
    # Given an environment with a dead proxy and a backend file naming the live one
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    transport._server.cache_clear()
    forget_sockets()
    via_proxy = replace(config, options=replace(config.options, proxy=proxy.url))
    assert score_both_ways(via_proxy) == [expected_score(config)] * 2
    assert proxy.counts["forwards"] == 4
    # and `proxy = ""` goes straight to the judge, whatever the environment says
    direct = replace(config, options=replace(config.options, proxy=""))
    assert score_both_ways(direct) == [expected_score(config)] * 2
    assert proxy.counts["forwards"] == 4


def test_a_proxy_refusing_the_tunnel_is_one_clear_line(tls_judge, certs):
    with ConnectProxy(refuse=True) as refusing:
        config = judge_config(tls_judge.url, ca_file=str(certs.ca), proxy=refusing.url)
        for message in failures_both_ways(config):
            assert message == (
                f"connection to {tls_judge.url}/v1/chat/completions (via proxy "
                f"{refusing.url.removeprefix('http://')}) failed: the proxy refused the tunnel: "
                "HTTP/1.1 403 Forbidden"), message
        assert refusing.counts["refused"] == 2


# --- Anthropic ------------------------------------------------------------------------------


def anthropic_config(url: str, **fields) -> Backend:
    dialect = DIALECTS["anthropic"]
    return judge_config(url, **{"dialect": "anthropic", "auth": dialect.auth,
                                "headers": dialect.headers,
                                "api_key_env": "QRQ_TEST_ANTHROPIC_KEY", **fields})


def test_the_anthropic_dialect_speaks_the_messages_api(monkeypatch):
    monkeypatch.setenv("QRQ_TEST_ANTHROPIC_KEY", "sk-ant-test-key-0123456789")
    with MockJudge(MockJudgeSettings(latency_ms=1, rpm=600)) as judge:
        check_anthropic_call(anthropic_config(judge.url, system_prompt="Be strict."))


def check_anthropic_call(config: Backend) -> None:
    client = make_backend(config)
    body = client.request([SAMPLE])
    assert body["system"] == "Be strict." and [m["role"] for m in body["messages"]] == ["user"]
    assert body["max_tokens"] == 16
    call = client.call([SAMPLE])
    assert call.scores == [expected_score(config)]
    assert call.usage is not None and call.tokens == sum(call.usage) > 0
    told = client.feedback(call).told  # its anthropic-ratelimit-* headers, as OpenAI's
    assert told.limit_requests == 600 and told.remaining_requests is not None
    assert told.reset_requests_s is not None and 0 <= told.reset_requests_s <= 1


def test_an_anthropic_529_is_flow_control_as_a_429_is(plain_judge, monkeypatch):
    monkeypatch.setenv("QRQ_TEST_ANTHROPIC_KEY", "sk-ant-test-key-0123456789")
    client = make_backend(anthropic_config(plain_judge.url))
    for call in (lambda s: client.call([s]), lambda s: asyncio.run(client.call_async([s]))):
        with pytest.raises(RateLimited) as caught:
            call({"prompt": "p", "response": "[[mock:529]]"})
        assert str(caught.value) == "overloaded (529)" and "overloaded_error" in \
            caught.value.detail
        assert client.feedback(caught.value).rate_limited


def test_the_anthropic_dialect_without_its_key_header_is_refused(plain_judge, monkeypatch):
    monkeypatch.setenv("QRQ_TEST_ANTHROPIC_KEY", "sk-ant-test-key-0123456789")
    client = make_backend(anthropic_config(plain_judge.url, auth="none"))
    with pytest.raises(PermanentError, match="request rejected with 401") as caught:
        client.call([SAMPLE])
    assert "authentication_error" in caught.value.detail


# --- headers, query, Azure: a server that shows what it got ----------------------------------


class Capture:
    """A judge of the tests' own that records each request (path, headers, body) and answers
    a chat completion; a prompt holding `echo:500` is answered 500 quoting every header."""

    def __init__(self) -> None:
        outer, self.requests = self, []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, dict(self.headers), body))
                status, reply = 200, json.dumps({
                    "choices": [{"message": {"content": "Score: 0.5"}}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
                if "echo:500" in json.dumps(body):
                    status, reply = 500, f"gateway failed; headers: {dict(self.headers)}"
                data = reply.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def capture():
    server = Capture()
    yield server
    server.close()


def write_backend(directory: Path, backend: dict, name: str = "j") -> Backend:
    path = directory / f"{name}.toml"
    path.write_text(toml_tables({"backend": {"kind": "judge", "model": "m", **backend}}))
    return load_backend(path)


def test_the_azure_form(capture, tmp_path, monkeypatch):
    # Given an Azure OpenAI deployment's backend file: dialect, URL and key only
    monkeypatch.setenv("QRQ_TEST_AZURE_KEY", "azure-key-0123456789abcdef")
    config = write_backend(tmp_path, {
        "dialect": "azure", "url": f"{capture.url}/openai/deployments/judge-4o",
        "api_key_env": "QRQ_TEST_AZURE_KEY"})
    # When it is called on each path
    assert score_both_ways(config) == [0.5, 0.5]
    # Then each request is Azure's: the deployment's path, api-version, the api-key header
    for path, headers, body in capture.requests:
        assert path == "/openai/deployments/judge-4o/chat/completions?api-version=2024-10-21"
        assert headers["api-key"] == "azure-key-0123456789abcdef"
        assert "Authorization" not in headers and body["messages"][-1]["role"] == "user"
    # and a file's own api-version replaces the shorthand's
    config = write_backend(tmp_path, {
        "dialect": "azure", "url": f"{capture.url}/openai/deployments/judge-4o",
        "api_key_env": "QRQ_TEST_AZURE_KEY", "query": {"api-version": "2025-01-01-preview"}})
    make_backend(config).call([SAMPLE])
    assert capture.requests[-1][0].endswith("/chat/completions?api-version=2025-01-01-preview")


def test_headers_and_query_read_their_variables_at_call_time_and_redact_them(
    capture, tmp_path, monkeypatch
):
    # Given a gateway that wants a project header, a token from the environment and a query
    secret = "gw-token-Zq81xLmP4vTr6NbK2"
    monkeypatch.setenv("QRQ_TEST_GATEWAY_TOKEN", secret)
    config = write_backend(tmp_path, {
        "url": f"{capture.url}/v1", "auth": "none", "api_key_env": "QRQ_TEST_UNUSED",
        "headers": {"X-Project": "rl-team", "X-Gateway-Token": "${QRQ_TEST_GATEWAY_TOKEN}"},
        "query": {"region": "eu"}})
    assert config.missing_api_key() is not None  # the key variable is named, and unset
    monkeypatch.setenv("QRQ_TEST_UNUSED", "never-sent-0123456789")
    # When a call is made
    assert make_backend(config).call([SAMPLE]).scores == [0.5]
    path, headers, _ = capture.requests[-1]
    # Then it carries them (and no key: auth = "none")
    assert path == "/v1/chat/completions?region=eu"
    assert headers["X-Project"] == "rl-team" and headers["X-Gateway-Token"] == secret
    assert "Authorization" not in headers
    # And when the gateway quotes them in an error, the error never holds the token
    with pytest.raises(TransientError) as caught:
        make_backend(config).call([{"prompt": "echo:500", "response": "r"}])
    assert "rl-team" in caught.value.detail and secret[:12] not in caught.value.detail
    assert "[REDACTED]" in caught.value.detail
    # And an unset variable stops the worker before any call, naming it
    monkeypatch.delenv("QRQ_TEST_GATEWAY_TOKEN")
    assert config.missing_api_key() == (
        f"{config.source}: backend.headers.X-Gateway-Token: environment variable "
        "QRQ_TEST_GATEWAY_TOKEN is not set in this process")


@pytest.mark.parametrize(("backend", "message"), [
    ({"auth": "basic"}, "backend.auth: expected one of bearer, api-key, x-api-key, none, got "
                        "'basic'"),
    ({"dialect": "gemini"}, "backend.dialect: expected one of openai, anthropic, azure, got "
                            "'gemini'"),
    ({"headers": {"Host": "x"}}, "backend.headers: 'Host' is not a header qrq can send"),
    ({"headers": {"X-Key": 12345}}, "backend.headers.X-Key: expected a text value on one line"),
    ({"ca_file": "nowhere.pem"}, "backend.ca_file: expected a PEM file (no file "),
    ({"proxy": "https://u:secret-pw@proxy:3128"}, 'backend.proxy: expected an http://host:port '
                                                  "URL, or \"\" for none, got "
                                                  "'https://proxy:3128'"),
    ({"verify": "no"}, "backend.verify: expected bool"),
])
def test_wrong_provider_settings_are_one_precise_line(tmp_path, backend, message):
    with pytest.raises(ConfigError) as caught:
        write_backend(tmp_path, {"url": "https://api.example.com/v1", **backend})
    assert message in str(caught.value), str(caught.value)


def test_a_reward_model_has_no_dialect(tmp_path):
    path = tmp_path / "rm.toml"
    path.write_text(toml_tables({"backend": {"kind": "reward_model", "url": "http://h/score",
                                             "dialect": "anthropic"}}))
    with pytest.raises(ConfigError, match=r"backend.dialect: unknown key"):
        load_backend(path)


# --- through real workers -------------------------------------------------------------------


def test_a_judge_with_priority_field_gets_each_calls_priority(capture, tmp_path, redis_url,
                                                              stack):
    # Given a self-hosted judge scheduling by priority, and one that does not
    backends = {name: judge_backend(capture.url, **extra) for name, extra in
                (("sched", {"priority_field": True}), ("plain", {}))}
    config_path = write_config(tmp_path, backends, redis_url=redis_url)
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    for worker in start_workers(config_path, [("sched", "sched@prio"), ("plain", "plain@prio")]):
        stack.callback(worker.kill)
    # When batches of each priority are scored on both
    sent = {}
    for route in ("sched", "plain"):
        for priority in ("val", "train", "bulk"):
            samples = [{"prompt": f"{route} {priority} {i}", "response": "r"} for i in range(3)]
            outcomes = qreward_queue.submit_batch(samples, route=route, priority=priority,
                                                  app=app, deadline_s=30).outcomes()
            assert [o.score for o in outcomes] == [0.5] * 3, outcomes
            sent[route, priority] = {body.get("priority", "none") for _, _, body in
                                     capture.requests
                                     if body["messages"][-1]["content"].count(f"{route} "
                                                                                f"{priority}")}
    # Then the scheduling judge got vLLM's `priority`, lower first: val 0, train 6, bulk 9
    assert sent == {("sched", "val"): {0}, ("sched", "train"): {6}, ("sched", "bulk"): {9},
                    ("plain", "val"): {"none"}, ("plain", "train"): {"none"},
                    ("plain", "bulk"): {"none"}}


def test_a_worker_reaches_a_tls_judge_through_the_proxy_of_its_environment(
    tls_judge, certs, tmp_path, redis_url, stack
):
    # Given a TLS judge with a private CA, a forward proxy in HTTPS_PROXY, and two backends:
    # one trusting the CA (ca_file), one with verify = false
    proxy = stack.enter_context(ConnectProxy())
    backends = {"trusted": judge_backend(tls_judge.url, ca_file=str(certs.ca)),
                "unchecked": judge_backend(tls_judge.url, verify=False)}
    config_path = write_config(tmp_path, backends, redis_url=redis_url)
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    env = {"HTTPS_PROXY": proxy.url, "NO_PROXY": ""}
    workers = start_workers(config_path, [("trusted", "trusted@tls", env),
                                          ("unchecked", "unchecked@tls", env)])
    for worker in workers:
        stack.callback(worker.kill)
    # When a batch is scored on each
    samples = [{"prompt": f"tls question {i}", "response": f"answer {i}"} for i in range(6)]
    for route in backends:
        outcomes = qreward_queue.submit_batch(samples, route=route, app=app,
                                              deadline_s=30).outcomes()
        # Then every sample is scored right, through tunnels of the proxy
        assert [o.score for o in outcomes] == [expected(app, route, s) for s in samples]
    assert proxy.counts["tunnels"] >= 2
    # and only the worker with verify = false warned, at its start, in one line
    warning = "backend.verify = false: the TLS certificate of backend 'unchecked' is not checked"
    assert warning in workers[1].log.read_text()
    assert "verify = false" not in workers[0].log.read_text()


RPM, SHARE_N = 1200, 240  # the judge allows 20 calls/s; 12 s of work at its limit


@pytest.mark.slow
def test_the_anthropic_dialect_reaches_the_same_share_of_a_limit_as_openai(
    tmp_path, redis_url, stack
):
    # Given a judge allowing 1,200 requests a minute behind both APIs, and backend files that
    # believe 6,000 (5x too many): the limiter must learn the real limit from the replies
    judge = stack.enter_context(spawn(MockJudgeSettings(rpm=RPM, latency_ms=50, seed=3)))
    limits = {"rpm": RPM * 5, "max_concurrent": 64}
    backends = {
        "oa": {**judge_backend(judge.url), "limits": limits},
        "an": {**judge_backend(judge.url, dialect="anthropic",
                               api_key_env="QRQ_TEST_ANTHROPIC_KEY"), "limits": limits},
    }
    config_path = write_config(tmp_path, backends, redis_url=redis_url)
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    env = {"QRQ_TEST_ANTHROPIC_KEY": "sk-ant-test-key-0123456789"}
    shares, refused = {}, {}
    for route in backends:  # one at a time: each has the judge's limit to itself
        (worker,) = start_workers(config_path, [(route, f"{route}@share", env)])
        stack.callback(worker.kill)
        judge.reset()
        samples = [{"prompt": f"{route} share {i}", "response": "r"} for i in range(SHARE_N)]
        started = time.monotonic()
        outcomes = qreward_queue.submit_batch(samples, route=route, app=app,
                                              deadline_s=120).outcomes()
        elapsed = time.monotonic() - started
        # When the batch is scored, then every sample is scored right
        assert [o.status for o in outcomes] == ["ok"] * SHARE_N, \
            [o for o in outcomes if o.status != "ok"][:3]
        assert [o.score for o in outcomes] == [expected(app, route, s) for s in samples]
        stats = judge.stats()
        shares[route] = stats["accepted"] / (elapsed * RPM / 60)
        refused[route] = stats["rate_limited"]
        worker.stop()
    # Then both dialects got the same share of the judge's limit (within 15 points), and a
    # good one: the Anthropic headers and 429s taught the limiter as OpenAI's do
    print(f"\nshare of the judge's limit (429s): openai {shares['oa']:.2f} ({refused['oa']}), "
          f"anthropic {shares['an']:.2f} ({refused['an']})")
    assert abs(shares["an"] - shares["oa"]) <= 0.15, shares
    assert min(shares.values()) >= 0.6, shares


@pytest.mark.parametrize(("file", "dialect", "auth"), [
    ("anthropic.toml.example", "anthropic", "x-api-key"),
    ("azure-openai.toml.example", "azure", "api-key"),
    ("gemini.toml.example", "openai", "bearer"),
    ("gateway.toml.example", "openai", "bearer"),
])
def test_provider_templates_speak_their_dialect_and_leave_sizing_to_the_worker(
    file, dialect, auth
):
    backend = load_backend(Path(__file__).resolve().parents[2] / "workers" / file)
    assert (backend.options.dialect, backend.options.auth) == (dialect, auth)
    assert backend.pool.sized  # 3 x rpm/60 x latency calls in flight (README: sizing a pool)
