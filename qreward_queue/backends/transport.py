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

import asyncio
import contextlib
import json
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
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
_idle: dict[_Server, list[_Connection]] = {}  # the call loop's kept-alive connections


def _forget_sockets() -> None:
    global _local
    _local = threading.local()  # a forked child must not share its parent's sockets
    _idle.clear()


os.register_at_fork(after_in_child=_forget_sockets)


@dataclass
class Reply:
    status_code: int
    headers: dict[str, str]
    body: Any
    raw: bytes = b""  # the body as the server sent it (a pass-through call hands it back)


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


async def connect_async(url: str, timeout_s: float) -> None:
    """`connect` for the call loop: one more kept-alive connection to `url`'s server."""
    server = _server(url)
    with contextlib.suppress(TransientError):
        _idle.setdefault(server, []).append(await _connect_async(server, timeout_s))


def post_json(config: Backend, url: str, payload: dict) -> Reply:
    """POST `payload`; return the decoded 200 reply or raise the error its status means."""
    server, request = _request(config, url, payload)
    deadline = time.monotonic() + config.timeout_s
    while True:
        sock, reused = _take_socket(server, config.timeout_s)
        outcome = _attempt(sock, request, deadline)
        keep = partial(_kept().__setitem__, server, sock)
        if (reply := _finished(config, server, sock, outcome, reused, keep)) is not None:
            return reply


async def post_json_async(config: Backend, url: str, payload: dict) -> Reply:
    """`post_json` on the running event loop (the worker's call loop): the same request,
    errors and reply, over the loop's kept-alive connections."""
    server, request = _request(config, url, payload)
    deadline = asyncio.get_running_loop().time() + config.timeout_s
    while True:
        conn, reused = await _take_connection(server, deadline)
        outcome = await conn.exchange(request, deadline)
        keep = partial(_idle.setdefault(server, []).append, conn)
        if (reply := _finished(config, server, conn, outcome, reused, keep)) is not None:
            return reply


def _finished(config: Backend, server: _Server, conn: socket.socket | _Connection,
              outcome: _Response | BaseException, reused: bool, keep: Callable[[], None]
              ) -> Reply | None:
    """The reply of one exchange on `conn` (kept by `keep` when the server keeps it open),
    or the error a failed exchange means, naming the server (never the URL's credentials);
    None: the request goes once more on a new connection (a kept-alive one the server had
    closed while it was idle)."""
    if isinstance(outcome, _Response):
        if outcome.keep_alive:
            keep()
        else:
            conn.close()
        return _reply(config, server, outcome)
    conn.close()
    if isinstance(outcome, (_Unanswered, ConnectionResetError, BrokenPipeError)) and reused:
        return None
    if isinstance(outcome, TimeoutError):
        raise TransientError(f"no reply from {server.where} within {config.timeout_s:g} s",
                             timed_out=True) from None
    if isinstance(outcome, (httptools.HttpParserError, OSError)):  # refused, reset, cut short
        raise _failed(server, outcome) from None
    raise outcome


def _request(config: Backend, url: str, payload: dict) -> tuple[_Server, bytes]:
    """Where the request goes, and its bytes: head and body, sent in one write."""
    server = _server(url)
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
    return server, f"{server.head}{extra}Content-Length: {len(body)}\r\n\r\n".encode() + body


def _reply(config: Backend, server: _Server, resp: _Response) -> Reply:
    """The decoded 200 reply, or the error its status (or its body) means."""
    where = server.where
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
    return Reply(resp.status, reply_headers, body, raw)


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

    def closed(self, received: int) -> None:
        """The server closed the connection after `received` bytes of this reply: complete if
        its body ends where the connection does, else the error saying how it was cut."""
        if not received:
            raise _Unanswered("RemoteDisconnected")
        if self.headers_done and "content-length" not in self.headers \
                and "transfer-encoding" not in self.headers:
            self.complete, self.keep_alive = True, False  # a body that ends with the connection
            return
        raise _Incomplete("IncompleteRead")


def _attempt(sock: socket.socket, request: bytes, deadline: float) -> _Response | BaseException:
    """`_exchange`, its failure returned (to `_finished`, which closes the socket first)."""
    try:
        return _exchange(sock, request, deadline)
    except BaseException as exc:
        return exc


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
            resp.closed(received)
            break
        received += len(data)
        resp.parser.feed_data(data)
    resp.keep_alive = resp.keep_alive and resp.complete
    return resp


async def _take_connection(server: _Server, deadline: float) -> tuple[_Connection, bool]:
    """A kept-alive connection of the loop to `server` (True), or a new one (False)."""
    idle = _idle.setdefault(server, [])
    while idle:
        conn = idle.pop()
        if not conn.closed:  # else the server closed it while it was idle
            return conn, True
    return await _connect_async(server, deadline - asyncio.get_running_loop().time()), False


async def _connect_async(server: _Server, timeout_s: float) -> _Connection:
    loop = asyncio.get_running_loop()
    connecting = loop.create_connection(  # TCP_NODELAY is asyncio's default
        _Connection, server.host, server.port, ssl=_tls() if server.tls else None)
    try:
        _, conn = await asyncio.wait_for(connecting, min(CONNECT_TIMEOUT_S, max(0.001, timeout_s)))
    except (OSError, asyncio.TimeoutError) as exc:  # refused, unreachable, no handshake, TLS...
        raise _failed(server, exc) from None
    return conn


class _Connection(asyncio.Protocol):
    """One kept-alive connection of the call loop, one exchange at a time (as `_exchange`):
    the request in one write, the reply fed to httptools as it arrives, all by a deadline."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._resp = _Response()
        self._received = 0
        self._waiter: asyncio.Future[_Response | BaseException] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def exchange(self, request: bytes, deadline: float
                 ) -> asyncio.Future[_Response | BaseException]:
        """Send `request`; the future's result is the reply, or what ended the exchange (by
        the loop's clock `deadline` at the latest: TimeoutError)."""
        loop = asyncio.get_running_loop()
        self._resp, self._received = _Response(), 0
        self._waiter = loop.create_future()
        self._timer = loop.call_at(deadline, self._end, TimeoutError())
        assert self.transport is not None
        self.transport.write(request)
        return self._waiter

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:  # bytes nobody asked for: the connection is not kept
            self.close()
            return
        resp = self._resp
        self._received += len(data)
        try:
            resp.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._end(exc)
            return
        if resp.complete or resp.size > MAX_REPLY_BYTES:  # read no further past the bound
            resp.keep_alive = resp.keep_alive and resp.complete
            self._end(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is None:  # closed while idle: the next exchange takes a new one
            return
        try:
            self._resp.closed(self._received)
        except ConnectionError as error:
            self._end(error)
        else:
            self._end(None)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _end(self, error: BaseException | None) -> None:
        """The exchange is over: its reply, or `error`."""
        waiter, self._waiter = self._waiter, None
        if self._timer is not None:
            self._timer.cancel()
        if waiter is not None and not waiter.done():
            waiter.set_result(self._resp if error is None else error)


def _reason(exc: BaseException) -> str:
    """The error's class (ConnectionRefusedError...), never the URL again."""
    return str(exc) if isinstance(exc, (_Unanswered, _Incomplete)) else type(exc).__name__
