"""Pooled HTTP for the judge and reward-model backends, and the classification of replies.

Keep-alive sockets, one per calling thread and server: a worker's calls run on a fixed set of
threads (its call pool), each making one call at a time, so a socket per thread is a pool with
no locking. A request goes out in one write (head and body together); the standard library's
`http.client.HTTPResponse` reads the reply. Measured against the mock judge from 48 threads
(`python benchmarks/http_clients.py`), this costs about as much CPU per call as asyncio +
aiohttp, and a third less than urllib3's PoolManager (qrq's client before). No environment or
proxy lookups, no retries of its own (qrq's retry policy decides; only a kept-alive socket the
server had closed is replaced and the request sent again), no redirects (a 3xx is an error
naming where it pointed: prompts are never re-sent elsewhere). Every call ends by `timeout_s`
in total, however slowly the server trickles its reply.
"""

from __future__ import annotations

import http.client
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

from ..config import Backend, redact_url
from ..errors import PermanentError, RateLimited, TransientError
from ..ratelimit_headers import RateLimitHeaders

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
    return _Server(tls, host, port, head)


@cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


def _take_socket(server: _Server, timeout_s: float, where: str) -> tuple[socket.socket, bool]:
    """This thread's kept-alive socket to `server` (True), or a new connection (False)."""
    kept = _local.__dict__.setdefault("sockets", {}).pop(server, None)
    if kept is not None:
        return kept, True
    try:
        sock = socket.create_connection((server.host, server.port),
                                        timeout=min(CONNECT_TIMEOUT_S, timeout_s))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if server.tls:
            sock = _tls().wrap_socket(sock, server_hostname=server.host)
    except OSError as exc:  # refused, unreachable, unknown host, no handshake, TLS...
        raise TransientError(f"connection to {where} failed: {_reason(exc)}") from None
    return sock, False


def post_json(config: Backend, url: str, payload: dict) -> Reply:
    """POST `payload`; return the decoded 200 reply or raise the error its status means."""
    server, where = _server(url), redact_url(url)
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
        sock, reused = _take_socket(server, config.timeout_s, where)
        try:
            resp, raw = _exchange(sock, request, deadline)
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as exc:
            sock.close()
            if reused:  # the server had closed it while it was idle: once more, on a new one
                continue
            raise TransientError(f"connection to {where} failed: {_reason(exc)}") from None
        except TimeoutError:
            sock.close()
            raise TransientError(
                f"no reply from {where} within {config.timeout_s:g} s", timed_out=True
            ) from None
        except (http.client.HTTPException, OSError) as exc:
            sock.close()
            raise TransientError(f"connection to {where} failed: {_reason(exc)}") from None
        except BaseException:
            sock.close()
            raise
        if resp.will_close or len(raw) > MAX_REPLY_BYTES:
            sock.close()
        else:
            _local.__dict__.setdefault("sockets", {})[server] = sock
        break
    reply_headers = {k.lower(): v for k, v in resp.getheaders()}
    facts = {"status_code": resp.status, "headers": reply_headers}
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
    if len(raw) > MAX_REPLY_BYTES:
        raise PermanentError(f"reply larger than {MAX_REPLY_BYTES} bytes", **facts)
    try:
        body = json.loads(raw)
    except ValueError:
        raise PermanentError("reply is not JSON", text, **facts) from None
    return Reply(resp.status, reply_headers, body)


def _exchange(sock: socket.socket, request: bytes,
              deadline: float) -> tuple[http.client.HTTPResponse, bytes]:
    """Send `request` in one write; read the reply's status, headers and body by `deadline`."""
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    sock.sendall(request)
    resp = http.client.HTTPResponse(sock, method="POST")
    try:
        resp.begin()
        return resp, _read_until(sock, resp, deadline)
    finally:
        resp.close()  # the reply's reader, not the socket


def _read_until(sock: socket.socket, resp: http.client.HTTPResponse, deadline: float) -> bytes:
    """The body, at most MAX_REPLY_BYTES + 1 bytes, read piece by piece so that a server
    trickling its reply cannot hold the call past `deadline`."""
    parts, size = [], 0
    while size <= MAX_REPLY_BYTES:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        if parts:  # a reply in several pieces: each read waits only for the time left
            sock.settimeout(left)
        piece = resp.read1(MAX_REPLY_BYTES + 1 - size)
        if not piece:
            if resp.length:  # the server closed before the Content-Length it announced
                raise http.client.IncompleteRead(b"".join(parts), resp.length)
            break
        parts.append(piece)
        size += len(piece)
    return b"".join(parts)


def _reason(exc: BaseException) -> str:
    """The error's class (ConnectionRefusedError...), never the URL again."""
    return type(exc).__name__
