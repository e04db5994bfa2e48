"""The HTTP server: it routes each endpoint, admits a scoring call, sits out its latency and
faults, and replies; MockJudge runs it on a thread of this process.

Endpoints:
    POST /v1/chat/completions  {"model", "messages": [{"role", "content"}, ...], "max_tokens"?}
                               -> an OpenAI chat.completion saying "... Score: 0.42"
    POST /v1/completions       {"model", "prompt": text (or a list of one), "max_tokens"?} ->
                               a text_completion: the prompt judged as a chat call's one user
                               message, its text in choices[0].text
    POST /v1/messages          Anthropic's Messages API (anthropic.py)
    POST /v1/rewards           {"items": [{"prompt", "response"}, ...]} -> {"scores", "usage"}
    GET /stats, POST /stats/reset, GET /health
    POST /hold {"answer": n}   answer n more calls, then hold every reply until POST /release
                               (tests that must act while a batch is surely unfinished)

/stats counts requests (every POST), accepted, rate_limited, errors, ... and the usage it
billed in its 200 replies: prompt_tokens and completion_tokens (the truth spend is checked by).
`items` counts what was scored in bulk: rewards items, and the responses of group prompts
answered well-formed.

Faults of an admitted call, in this order (after [[mock:400]], which wire.py refuses first):
    [[mock:hang]]       sleep hang_s first, then answer as below
    [[mock:hang-once]]  the same, only for the first request that judges this text
    [[mock:500]]        500 server_error
    [[mock:500-once]]   the same, only for the first request that judges this text
    [[mock:badjson]]    200 whose body is not JSON
    [[mock:garbage]]    200 without a score (verdicts.py, wire.py)
"""

from __future__ import annotations

import json
import math
import ssl
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from .anthropic import _anthropic_call, _anthropic_reply
from .limits import _ceil_ms, _duration, _Judge, _Ticket
from .settings import MockJudgeSettings
from .wire import (
    _BAD_JSON,
    Json,
    _BadRequest,
    _Call,
    _completion_call,
    _error,
    _parse_chat,
    _parse_rewards,
)


class _Server(ThreadingHTTPServer):
    """One thread per connection, with a backlog deep enough for bursts of ~200 clients."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 1024

    def __init__(self, settings: MockJudgeSettings) -> None:
        self.judge = _Judge(settings)
        super().__init__((settings.host, settings.port), _Handler)
        if settings.tls_cert:  # each connection's handshake on its own thread, at first read
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(settings.tls_cert, settings.tls_key or None)
            self.socket = context.wrap_socket(self.socket, server_side=True,
                                              do_handshake_on_connect=False)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client hanging up is not news
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    disable_nagle_algorithm = True  # headers and body go out as separate writes
    server: _Server
    anthropic = False  # this request came to /v1/messages: answered in Anthropic's shapes

    def setup(self) -> None:
        super().setup()
        self.server.judge.count("connections_opened")

    def log_message(self, format: str, *args: Any) -> None:
        """Stay quiet: benchmarks send thousands of requests."""

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        judge = self.server.judge
        path = urlsplit(self.path).path
        self.anthropic = path == "/v1/messages"
        try:
            body = self._read_body()
        except _BadRequest as exc:
            self.close_connection = True  # the next request's start is unknown
            self._send_json(400, _error(str(exc), "invalid_request_error"))
            return
        match self.command, path:
            case "POST", "/v1/chat/completions":
                self._score(body, lambda chat: _parse_chat(chat, judge.settings))
            case "POST", "/v1/completions":
                self._score(body, lambda raw: _completion_call(raw, judge.settings))
            case "POST", "/v1/rewards":
                self._score(body, _parse_rewards)
            case "POST", "/v1/messages":
                self._messages(body)
            case "GET", "/stats":
                self._send_json(200, judge.stats())
            case "POST", "/stats/reset":
                judge.reset()
                self._send_json(200, judge.stats())
            case "POST", "/hold":
                judge.hold_after(int(json.loads(body or b"{}").get("answer", 0)))
                self._send_json(200, judge.stats())
            case "POST", "/release":
                judge.hold_after(None)
                self._send_json(200, judge.stats())
            case "GET", "/health":
                self._send_json(200, {"ok": True})
            case _:
                message = f"unknown endpoint: {self.command} {path}"
                self._send_json(404, _error(message, "invalid_request_error"))

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise _BadRequest("chunked request bodies are not supported; send Content-Length")
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = -1
        if length < 0:
            raise _BadRequest("'Content-Length' header must be a non-negative integer")
        return self.rfile.read(length)

    def _score(self, body: bytes, parse: Callable[[bytes], _Call]) -> None:
        judge = self.server.judge
        judge.count("requests")
        try:
            call = parse(body)
        except _BadRequest as exc:
            judge.count("client_errors")
            self._send_json(400, _error(str(exc), "invalid_request_error"))
            return
        ticket = judge.admit(call.tokens)
        if ticket.refusal:
            judge.count("rate_limited")
            kind, message, wait = ticket.refusal
            ms = max(1, _ceil_ms(wait))
            message = f"{message}. Please try again in {_duration(wait)}."
            headers = {
                **ticket.headers,
                "Retry-After": str(max(1, math.ceil(ms / 1000))),
                "retry-after-ms": str(ms),
            }
            self._send_json(429, _error(message, kind, "rate_limit_exceeded"), headers)
            return
        try:
            status, response = self._answer(call, ticket)
        finally:
            judge.release()  # before replying, so a client's next request finds the slot free
        self._send(status, response, ticket.headers)

    def _messages(self, body: bytes) -> None:
        """Anthropic's Messages API: its headers checked, then judged as the chat route."""
        judge = self.server.judge
        if not self.headers.get("x-api-key"):
            judge.count("client_errors")
            self._send_json(401, _error("x-api-key header is required", "authentication_error"))
        elif not self.headers.get("anthropic-version"):
            judge.count("client_errors")
            self._send_json(400, _error("anthropic-version header is required", "invalid"))
        elif b"[[mock:529]]" in body:
            judge.count("requests")
            judge.count("rate_limited")
            self._send_json(529, _error("Overloaded", "overloaded_error"))
        else:
            self._score(body, lambda raw: _anthropic_call(raw, judge.settings))

    def _answer(self, call: _Call, ticket: _Ticket) -> tuple[int, bytes]:
        """Sit out the simulated latency and faults of an admitted call, then build its reply."""
        judge = self.server.judge
        judge.wait_turn()
        judge.pause(ticket.latency_s)
        if ticket.hang or "hang" in call.triggers or (
                "hang-once" in call.triggers and judge.first_time("hang", call.text)):
            judge.count("hangs")
            judge.pause(judge.settings.hang_s)
        if ticket.error or "500" in call.triggers or (
                "500-once" in call.triggers and judge.first_time("500", call.text)):
            judge.count("errors")
            message = "The server had an error while processing your request."
            return 500, json.dumps(_error(message, "server_error")).encode()
        judge.count("accepted")
        if "badjson" in call.triggers:
            return 200, _BAD_JSON
        judge.count("items", call.items)
        judge.count("prompt_tokens", call.usage[0])
        judge.count("completion_tokens", call.usage[1])
        return 200, json.dumps(call.reply()).encode()

    def _send_json(self, status: int, payload: Json, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(payload).encode(), headers or {})

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        if self.anthropic:
            body, headers = _anthropic_reply(status, body, headers)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)


class MockJudge:
    """The mock judge in this process, serving from a daemon thread; binds its port at once."""

    def __init__(self, settings: MockJudgeSettings | None = None) -> None:
        self.settings = settings or MockJudgeSettings()
        self._server = _Server(self.settings)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        scheme = "https" if self.settings.tls_cert else "http"
        # typeshed allows a bytes host (AF_UNIX); this AF_INET server's is a str
        return f"{scheme}://{host}:{port}"  # type: ignore[str-bytes-safe]

    def start(self) -> MockJudge:
        if self._thread is None:
            # a short poll interval keeps stop() fast; shutdown() waits for the next poll
            self._thread = threading.Thread(
                target=self._server.serve_forever,
                kwargs={"poll_interval": 0.05},
                name="mock-judge",
                daemon=True,
            )
            self._thread.start()
        return self

    def stats(self) -> dict[str, int]:
        return self._server.judge.stats()

    def reset(self) -> None:
        self._server.judge.reset()

    def hold(self, answer: int = 0) -> None:
        """Answer `answer` more calls, then hold every reply until `release()`."""
        self._server.judge.hold_after(answer)

    def release(self) -> None:
        self._server.judge.hold_after(None)

    def stop(self) -> None:
        self.release()
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()
        self._server.judge.stopping.set()

    def __enter__(self) -> MockJudge:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
