"""The HTTP transport of the judge and reward-model backends, and the classification of replies.

Only a call (or a connect) loads it: a trainer reads the kinds' facts (`http.HttpBackend`)
without the sockets or httptools.

Keep-alive sockets, one per calling thread and server: a worker's calls run on a fixed set of
threads (its call pool), each making one call at a time, so a socket per thread is a pool with
no locking. A request goes out in one write (head and body together); httptools (llhttp, the
C parser of Node.js and uvicorn) reads the reply. Measured against the mock judge from 48
threads (`python benchmarks/http_clients.py`), this costs less CPU per call than asyncio +
aiohttp and half of what urllib3's PoolManager (qrq's client before) costs. No retries of
its own (qrq's retry policy decides; only a kept-alive socket the server had closed is
replaced and the request sent again), no redirects (a 3xx is an error
naming where it pointed: prompts are never re-sent elsewhere). Every call ends by `timeout_s`
in total, however slowly the server trickles its reply.

Providers: the API key goes in the header the backend's `auth` names, with its extra `headers`
and `query` parameters. TLS trusts the system's store (SSL_CERT_FILE replaces it) or the
backend's `ca_file`. A proxy (the backend's `proxy`, else HTTPS_PROXY / HTTP_PROXY unless
NO_PROXY names the host) carries HTTPS in a CONNECT tunnel (TLS with the server inside it) and
plain HTTP as a full-URL request. The sync path (`post_json`) and the call loop's
(`post_json_async`) share every decision (`_server`, `_request`, `_tunnel_opened`, `_reply`)
and differ only in their socket I/O.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import unquote, urlencode, urlsplit, urlunsplit
from urllib.request import getproxies_environment, proxy_bypass

import httptools

from ..background import PerProcess
from ..config.model import Backend
from ..config.toml_table import expand_env
from ..errors import ConfigError, PermanentError, RateLimited, ScoringError, TransientError
from ..flow.ratelimit_headers import RATE_LIMITED_STATUSES, RateLimitHeaders
from ..redact import redact_url, remember

if TYPE_CHECKING:
    from .http import HttpOptions

AUTH_HEADERS = {  # `auth` in a backend file: how the API key is sent
    "bearer": "Authorization: Bearer {key}\r\n",
    "api-key": "api-key: {key}\r\n",  # Azure OpenAI
    "x-api-key": "x-api-key: {key}\r\n",  # Anthropic
    "none": "",
}
MAX_HEAD_BYTES = 64 << 10  # a proxy's answer to CONNECT
MAX_REPLY_BYTES = 8 << 20
CONNECT_TIMEOUT_S = 5.0
# a forked child must not share its parent's sockets: it opens its own
_local = PerProcess(threading.local)
_idle: PerProcess[dict[_Server, list[_Connection]]] = PerProcess(dict)  # the call loop's


@dataclass
class Reply:
    status_code: int
    headers: dict[str, str]
    body: Any
    raw: bytes = b""  # the body as the server sent it (a pass-through call hands it back)


@dataclass(frozen=True)
class _Server:
    """Where a URL's requests go, parsed once: the server, and the proxy on the way."""

    host: str
    port: int
    head: str  # the request line and the fixed headers
    where: str  # the URL as messages name it: without credentials and query
    ssl: ssl.SSLContext | None  # the server's TLS (through the tunnel, with a proxy)
    via: tuple[str, int] | None = None  # the proxy connected to instead of the server
    tunnel: bytes | None = None  # the CONNECT request that opens a tunnel (HTTPS via a proxy)


@cache
def _server(url: str, query: tuple[tuple[str, str], ...] = (), proxy: str | None = None,
            ca_file: str | None = None, verify: bool = True) -> _Server:
    """`url`'s server, with the backend's query parameters, proxy (None: the environment's)
    and TLS trust."""
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    host = parts.hostname or ""
    port = parts.port or (443 if tls else 80)
    query_text = "&".join(filter(None, [parts.query, urlencode(
        [(k, _filled(v, f"query parameter {k!r}")) for k, v in query])]))
    target = (parts.path or "/") + (f"?{query_text}" if query_text else "")
    name = f"[{host}]" if ":" in host else host
    authority = f"{name}{f':{parts.port}' if parts.port else ''}"
    where = redact_url(urlunsplit(parts._replace(query="", fragment="")))
    context = _tls(ca_file, verify) if tls else None
    via, auth = _proxy(proxy, parts.scheme, host, port)
    tunnel = None
    if via and tls:  # HTTPS through a proxy: a CONNECT tunnel, TLS with the server inside
        tunnel = f"CONNECT {name}:{port} HTTP/1.1\r\nHost: {name}:{port}\r\n{auth}\r\n"
    elif via:  # plain HTTP through a proxy: the full URL as the target
        target = f"http://{authority}{target}"
    head = (f"POST {target} HTTP/1.1\r\nHost: {authority}\r\n{'' if tunnel else auth}"
            "Content-Type: application/json\r\nAccept-Encoding: identity\r\n")
    if via:
        where += f" (via proxy {via[0]}:{via[1]})"
    return _Server(host, port, head, where, context, via,
                   tunnel.encode("latin-1") if tunnel else None)


def _proxy(configured: str | None, scheme: str, host: str, port: int
           ) -> tuple[tuple[str, int] | None, str]:
    """The proxy to reach `host` through, and its Proxy-Authorization line: the backend's
    `proxy` ("" none), else HTTPS_PROXY / HTTP_PROXY unless NO_PROXY names the host."""
    if configured is None:
        if proxy_bypass(f"{host}:{port}"):  # NO_PROXY
            return None, ""
        configured = getproxies_environment().get(scheme)
    if not configured:
        return None, ""
    parts = urlsplit(configured if "://" in configured else f"http://{configured}")
    if parts.scheme != "http" or not parts.hostname:
        raise PermanentError(f"proxy {redact_url(configured)}: expected an http://host:port URL "
                             "(qrq speaks plain HTTP to a proxy, TLS to the server inside)")
    auth = ""
    if parts.username is not None:
        remember(parts.password)
        user = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        auth = f"Proxy-Authorization: Basic {base64.b64encode(user.encode()).decode()}\r\n"
    return (parts.hostname, parts.port or 80), auth


@cache
def _tls(ca_file: str | None = None, verify: bool = True) -> ssl.SSLContext:
    """The TLS context trusting `ca_file` (else the system's store, which SSL_CERT_FILE
    replaces); `verify = false` (warned about at worker start) checks nothing."""
    context = ssl.create_default_context(cafile=ca_file)
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["http/1.1"])
    return context


def _kept() -> dict[_Server, socket.socket]:
    """This thread's kept-alive sockets, by server."""
    return _local.get().__dict__.setdefault("sockets", {})


def _failed(server: _Server, exc: BaseException) -> TransientError:
    return TransientError(f"connection to {server.where} failed: {_reason(exc)}")


def _take_socket(server: _Server, timeout_s: float) -> tuple[socket.socket, bool]:
    """This thread's kept-alive socket to `server` (True), or a new connection (False)."""
    kept = _kept().pop(server, None)
    if kept is not None:
        return kept, True
    try:
        sock = socket.create_connection(server.via or (server.host, server.port),
                                        timeout=min(CONNECT_TIMEOUT_S, timeout_s))
    except OSError as exc:  # refused, unreachable, unknown host...
        raise _failed(server, exc) from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if server.tunnel:
            sock.sendall(server.tunnel)
            head = b""
            while b"\r\n\r\n" not in head and len(head) < MAX_HEAD_BYTES:
                data = sock.recv(65536)
                if not data:
                    break
                head += data
            _tunnel_opened(server, head)
        if server.ssl:
            sock = server.ssl.wrap_socket(sock, server_hostname=server.host)
    except BaseException as exc:  # no tunnel, no handshake, TLS...: the socket goes too
        sock.close()
        raise _failed(server, exc) if isinstance(exc, OSError) else exc from None
    return sock, False


def _tunnel_opened(server: _Server, head: bytes) -> None:
    """Check the proxy's answer to CONNECT: 200, else the error naming what it said."""
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise _failed(server, _NoTunnel(f"the proxy answered CONNECT with {line[:80]!r}"))
    if not 200 <= int(parts[1]) < 300:
        raise _failed(server, _NoTunnel(f"the proxy refused the tunnel: {line[:80]}"))


def connect(config: Backend, url: str) -> None:
    """Open this thread's kept-alive socket to `url`'s server before its first call (a worker's
    first batch then runs as fast as its later ones); a failure is left for that call to meet."""
    with contextlib.suppress(ScoringError):
        server = _server_of(config, url)
        if server not in _kept():
            _kept()[server] = _take_socket(server, config.timeout_s)[0]


async def connect_async(config: Backend, url: str) -> None:
    """`connect` for the call loop: one more kept-alive connection to `url`'s server."""
    with contextlib.suppress(ScoringError):
        server = _server_of(config, url)
        _idle.get().setdefault(server, []).append(await _connect_async(server, config.timeout_s))


def _options(config: Backend) -> HttpOptions:
    """`config`'s HTTP options (an HTTP kind's client, which checked them, calls here)."""
    return cast("HttpOptions", config.options)


def _server_of(config: Backend, url: str) -> _Server:
    http = _options(config)
    return _server(url, http.query, http.proxy, http.ca_file, http.verify)


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
        try:
            outcome = await conn.exchange(request, deadline)
        except asyncio.CancelledError:  # a hedge answered first: this exchange is abandoned
            conn.close()
            raise
        keep = partial(_idle.get().setdefault(server, []).append, conn)
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
    server, http = _server_of(config, url), _options(config)
    extra = "".join(f"{name}: {_filled(value, f'header {name!r}')}\r\n"
                    for name, value in http.headers)
    if config.api_key_env and http.auth != "none":
        key = config.api_key()
        what = f"environment variable {config.api_key_env} (the API key of backend " \
               f"{config.name!r})"
        if not key:
            raise PermanentError(f"{what} is not set")
        if "\r" in key or "\n" in key:
            raise PermanentError(f"{what} holds a line break")
        extra += AUTH_HEADERS[http.auth].format(key=key)
    body = json.dumps(payload).encode()
    return server, f"{server.head}{extra}Content-Length: {len(body)}\r\n\r\n".encode() + body


def _filled(value: str, what: str) -> str:
    """A header's or query parameter's value with its `${VAR}`s read from the environment;
    what it read is a secret from now on (redacted as the API key is)."""
    if "${" not in value:
        return value
    try:
        filled = expand_env(value, what)
    except ConfigError as exc:
        raise PermanentError(str(exc)) from None
    remember(filled)
    if "\r" in filled or "\n" in filled:
        raise PermanentError(f"{what} holds a line break once its variables are filled")
    return filled


def _reply(config: Backend, server: _Server, resp: _Response) -> Reply:
    """The decoded 200 reply, or the error its status (or its body) means."""
    where = server.where
    raw, reply_headers = resp.body, resp.headers
    facts: dict[str, Any] = {"status_code": resp.status, "headers": reply_headers}
    text = raw[:500].decode("utf-8", "replace")
    if resp.status in RATE_LIMITED_STATUSES:
        told = RateLimitHeaders.from_headers(reply_headers, None, config.limits.max_pause_s)
        note = f" [bounded: {'; '.join(told.bounded)}]" if told.bounded else ""
        what = "overloaded" if resp.status == 529 else "rate limited"
        raise RateLimited(f"{what} ({resp.status})", text + note,
                          retry_after_s=told.retry_after_s, **facts)
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
    idle = _idle.get().setdefault(server, [])
    while idle:
        conn = idle.pop()
        if not conn.closed:  # else the server closed it while it was idle
            return conn, True
    return await _connect_async(server, deadline - asyncio.get_running_loop().time()), False


async def _connect_async(server: _Server, timeout_s: float) -> _Connection:
    try:
        return await asyncio.wait_for(_open(server),
                                      min(CONNECT_TIMEOUT_S, max(0.001, timeout_s)))
    except (OSError, asyncio.TimeoutError) as exc:  # refused, unreachable, no handshake, TLS...
        raise _failed(server, exc) from None


async def _open(server: _Server) -> _Connection:
    """A new connection of the loop to `server`: direct (TLS from the start) or through its
    proxy (CONNECT, then TLS with the server inside the tunnel)."""
    loop = asyncio.get_running_loop()
    direct = server.ssl if server.tunnel is None else None
    host, port = server.via or (server.host, server.port)
    _, conn = await loop.create_connection(  # TCP_NODELAY is asyncio's default
        _Connection, host, port, ssl=direct, server_hostname=server.host if direct else None)
    if server.tunnel is None:
        return conn
    try:
        _tunnel_opened(server, await conn.handshake(server.tunnel))
        if server.ssl is not None:
            assert conn.transport is not None
            conn.transport = await loop.start_tls(
                conn.transport, conn, server.ssl, server_hostname=server.host)
    except BaseException:  # no tunnel, no handshake, TLS, a timeout: the connection goes too
        conn.close()
        raise
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
        self._tunnel: asyncio.Future[bytes] | None = None  # a CONNECT waiting for its answer
        self._head = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def handshake(self, request: bytes) -> asyncio.Future[bytes]:
        """Send a proxy's CONNECT `request`; the future's result is the head of its answer."""
        self._head = bytearray()
        self._tunnel = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.transport.write(request)
        return self._tunnel

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
        if self._tunnel is not None:
            self._head += data
            if b"\r\n\r\n" in self._head or len(self._head) >= MAX_HEAD_BYTES:
                tunnel, self._tunnel = self._tunnel, None
                tunnel.set_result(bytes(self._head))
            return
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
        if self._tunnel is not None and not self._tunnel.done():
            self._tunnel.set_result(bytes(self._head))  # cut short: `_tunnel_opened` says so
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


class _NoTunnel(ConnectionError):
    """The proxy did not open the CONNECT tunnel."""


def _reason(exc: BaseException) -> str:
    """The error's class (ConnectionRefusedError...), or for TLS and tunnels what went wrong
    and what to do; never the URL again."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (f"its TLS certificate is not trusted ({exc.verify_message}): set ca_file in "
                "the backend file (or SSL_CERT_FILE) to the CA that signed it")
    if isinstance(exc, ssl.SSLError):
        return f"TLS handshake failed ({exc.reason or type(exc).__name__})"
    return str(exc) if isinstance(exc, (_Unanswered, _Incomplete, _NoTunnel)) \
        else type(exc).__name__
