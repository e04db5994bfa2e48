"""The HTTP transport of the judge and reward-model backends, and the classification of replies.

Only a call (or a connect) loads it: a trainer reads the kinds' facts (`http.HttpBackend`)
without the sockets or httptools.

Keep-alive sockets, one per calling thread and server: a worker's calls run on a fixed set of
threads (its call pool), each making one call at a time, so a socket per thread is a pool with
no locking. A request goes out in one write (head and body together); httptools (llhttp, the
C parser of Node.js and uvicorn) reads the reply. Measured against the mock judge from 48
threads (`python benchmarks/http_clients.py`), this costs less CPU per call than asyncio +
aiohttp and half of what urllib3's PoolManager (qrq's client before) costs. No environment or
proxy lookups, no retries of its own (qrq's retry policy decides; only a kept-alive socket the
server had closed is replaced and the request sent again), no redirects (a 3xx is an error
naming where it pointed: prompts are never re-sent elsewhere). Every call ends by `timeout_s`
in total, however slowly the server trickles its reply.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from functools import cache
from typing import Any
from urllib.parse import urlsplit

import httptools

from ..errors import PermanentError, RateLimited, TransientError
from ..flow.ratelimit_headers import RateLimitHeaders
from ..redact import redact_url
from ..settings import Backend

MAX_REPLY_BYTES = 8 << 20
CONNECT_TIMEOUT_S = 5.0
_local = threading.local()


def _forget_sockets() -> None:
    global _local
    _local = threading.local()  # a forked child must not share its parent's sockets


os.register_at_fork(after_in_child=_forget_sockets)


@dataclass
class Reply:
    status_code: int
    headers: dict[str, str]
    body: Any


@dataclass(frozen=True)
class _Server:
    """Where a URL's requests go, parsed once."""

    tls: bool
    host: str
    port: int
    head: str  # the request line and the fixed headers
    where: str  # the URL as messages name it: without credentials


@cache
def _server(url: str) -> _Server:
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    host = parts.hostname or ""
    port = parts.port or (443 if tls else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    name = f"[{host}]" if ":" in host else host
    head = (f"POST {target} HTTP/1.1\r\nHost: {name}{f':{parts.port}' if parts.port else ''}"
            "\r\nContent-Type: application/json\r\nAccept-Encoding: identity\r\n")
    return _Server(tls, host, port, head, redact_url(url))


@cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


def _kept() -> dict[_Server, socket.socket]:
    """This thread's kept-alive sockets, by server."""
    return _local.__dict__.setdefault("sockets", {})


def _failed(server: _Server, exc: BaseException) -> TransientError:
    return TransientError(f"connection to {server.where} failed: {_reason(exc)}")


def _take_socket(server: _Server, timeout_s: float) -> tuple[socket.socket, bool]:
    """This thread's kept-alive socket to `server` (True), or a new connection (False)."""
    kept = _kept().pop(server, None)
    if kept is not None:
        return kept, True
    try:
        sock = socket.create_connection((server.host, server.port),
                                        timeout=min(CONNECT_TIMEOUT_S, timeout_s))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if server.tls:
            sock = _tls().wrap_socket(sock, server_hostname=server.host)
    except OSError as exc:  # refused, unreachable, unknown host, no handshake, TLS...
        raise _failed(server, exc) from None
    return sock, False


def connect(url: str, timeout_s: float) -> None:
    """Open this thread's kept-alive socket to `url`'s server before its first call (a worker's
    first batch then runs as fast as its later ones); a failure is left for that call to meet."""
    server = _server(url)
    if server not in _kept():
        with contextlib.suppress(TransientError):
            _kept()[server] = _take_socket(server, timeout_s)[0]


def post_json(config: Backend, url: str, payload: dict) -> Reply:
    """POST `payload`; return the decoded 200 reply or raise the error its status means."""
    server = _server(url)
    where = server.where
    extra = ""
    if config.api_key_env:
        key = config.api_key()
        if not key:
            raise PermanentError(
                f"environment variable {config.api_key_env} (the API key of "
                f"backend {config.name!r}) is not set"
            )
        if "\r" in key or "\n" in key:
            raise PermanentError(f"environment variable {config.api_key_env} (the API key of "
                                 f"backend {config.name!r}) holds a line break")
        extra = f"Authorization: Bearer {key}\r\n"
    body = json.dumps(payload).encode()
    request = f"{server.head}{extra}Content-Length: {len(body)}\r\n\r\n".encode() + body
    deadline = time.monotonic() + config.timeout_s
    while True:
        sock, reused = _take_socket(server, config.timeout_s)
        try:
            resp = _exchange(sock, request, deadline)
        except (_Unanswered, ConnectionResetError, BrokenPipeError) as exc:
            sock.close()
            if reused:  # the server had closed it while it was idle: once more, on a new one
                continue
            raise _failed(server, exc) from None
        except TimeoutError:
            sock.close()
            raise TransientError(
                f"no reply from {where} within {config.timeout_s:g} s", timed_out=True
            ) from None
        except (httptools.HttpParserError, _Incomplete, OSError) as exc:
            sock.close()
            raise _failed(server, exc) from None
        except BaseException:
            sock.close()
            raise
        if not resp.keep_alive:
            sock.close()
        else:
            _kept()[server] = sock
        break
    raw, reply_headers = resp.body, resp.headers
    facts: dict[str, Any] = {"status_code": resp.status, "headers": reply_headers}
    text = raw[:500].decode("utf-8", "replace")
    if resp.status == 429:
        told = RateLimitHeaders.from_headers(reply_headers, None, config.limits.max_pause_s)
        note = f" [bounded: {'; '.join(told.bounded)}]" if told.bounded else ""
        raise RateLimited("rate limited (429)", text + note, retry_after_s=told.retry_after_s,
                          **facts)
    if resp.status >= 500:
        raise TransientError(f"server error {resp.status} from {where}", text, **facts)
    if 300 <= resp.status < 400:
        target = redact_url(reply_headers.get("location", "?"))
        raise PermanentError(
            f"{where} redirected ({resp.status}) to {target}; qrq does not follow redirects: "
            "put the final URL in the backend file",
            **facts,
        )
    if resp.status >= 400:
        raise PermanentError(f"request rejected with {resp.status}", text, **facts)
    if resp.size > MAX_REPLY_BYTES:
        raise PermanentError(f"reply larger than {MAX_REPLY_BYTES} bytes", **facts)
    try:
        body = json.loads(raw)
    except ValueError:
        raise PermanentError("reply is not JSON", text, **facts) from None
    return Reply(resp.status, reply_headers, body)


class _Unanswered(ConnectionError):
    """The server closed the connection before the first byte of a reply."""


class _Incomplete(ConnectionError):
    """The server closed the connection in the middle of a reply."""


class _Response:
    """One reply, as httptools' callbacks hand it over."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}
        self.parts: list[bytes] = []
        self.size = 0
        self.headers_done = self.complete = self.keep_alive = False

    @property
    def body(self) -> bytes:
        return b"".join(self.parts)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:  # llhttp forgets these once the message is complete
        self.headers_done = True
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        if self.size <= MAX_REPLY_BYTES:  # beyond it only the size matters
            self.parts.append(body)
        self.size += len(body)

    def on_message_complete(self) -> None:
        self.complete = True


def _exchange(sock: socket.socket, request: bytes, deadline: float) -> _Response:
    """Send `request` in one write; read the whole reply by `deadline`, however it trickles.
    A reply over MAX_REPLY_BYTES is read no further (and its socket not kept)."""
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    sock.sendall(request)
    resp, received = _Response(), 0
    while not resp.complete and resp.size <= MAX_REPLY_BYTES:
        if received:  # a reply in several pieces: each read waits only for the time left
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
        data = sock.recv(65536)
        if not data:
            if not received:
                raise _Unanswered("RemoteDisconnected")
            if resp.headers_done and "content-length" not in resp.headers \
                    and "transfer-encoding" not in resp.headers:
                break  # a body that ends where the connection does
            raise _Incomplete("IncompleteRead")
        received += len(data)
        resp.parser.feed_data(data)
    resp.keep_alive = resp.keep_alive and resp.complete
    return resp


def _reason(exc: BaseException) -> str:
    """The error's class (ConnectionRefusedError...), never the URL again."""
    return str(exc) if isinstance(exc, (_Unanswered, _Incomplete)) else type(exc).__name__
