"""Pooled HTTP for the judge and reward-model backends, and the classification of replies.

The standard library's `http.client`, one keep-alive connection per calling thread and server:
a worker's calls run on a fixed set of threads (its call pool), each making one call at a time,
so a connection per thread is a pool with no locking. Measured against the mock judge, 48
threads: 0.31 ms of CPU per call, against 0.79 ms through urllib3's PoolManager and 0.35 ms
for asyncio + aiohttp (`python benchmarks/http_clients.py`). No environment or proxy lookups,
no retries of its own (qrq's retry policy decides; only a kept-alive connection the server had
closed is replaced and the request sent again), no redirects (a 3xx is an error naming where it
pointed: prompts are never re-sent elsewhere). Every call ends by `timeout_s` in total, however
slowly the server trickles its reply.
"""

from __future__ import annotations

import http.client
import json
import os
import select
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


def _forget_connections() -> None:
    global _local
    _local = threading.local()  # a forked child must not share its parent's sockets


os.register_at_fork(after_in_child=_forget_connections)


@dataclass
class Reply:
    status_code: int
    headers: dict[str, str]
    body: Any


@cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


def _connection(url: str, timeout_s: float) -> tuple[http.client.HTTPConnection, bool]:
    """This thread's connection to `url`'s server, and whether it was kept alive from before."""
    parts = urlsplit(url)
    key = (parts.scheme, parts.hostname, parts.port)
    pool: dict = _local.__dict__.setdefault("connections", {})
    conn = pool.get(key)
    if conn is not None and conn.sock is not None and not _closed_by_server(conn.sock):
        return conn, True
    if conn is not None:
        conn.close()
    timeout = min(CONNECT_TIMEOUT_S, timeout_s)
    if parts.scheme == "https":
        conn = http.client.HTTPSConnection(parts.hostname, parts.port, timeout=timeout,
                                           context=_tls())
    else:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    pool[key] = conn
    return conn, False


def _closed_by_server(sock) -> bool:
    """An idle kept-alive socket that is readable has been closed (or spoken to out of turn)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def _target(url: str) -> str:
    parts = urlsplit(url)
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def post_json(config: Backend, url: str, payload: dict) -> Reply:
    """POST `payload`; return the decoded 200 reply or raise the error its status means."""
    headers = {"Content-Type": "application/json"}
    if config.api_key_env:
        key = config.api_key()
        if not key:
            raise PermanentError(
                f"environment variable {config.api_key_env} (the API key of "
                f"backend {config.name!r}) is not set"
            )
        headers["Authorization"] = f"Bearer {key}"
    where = redact_url(url)
    body = json.dumps(payload).encode()
    deadline = time.monotonic() + config.timeout_s
    for _ in range(2):  # a second time only when a kept-alive connection turns out closed
        conn, reused = _connection(url, config.timeout_s)
        try:
            resp, raw = _exchange(conn, url, body, headers, deadline, where)
            break
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as exc:
            conn.close()
            if not reused:
                raise TransientError(f"connection to {where} failed: {_reason(exc)}") from None
        except TimeoutError:
            conn.close()
            raise TransientError(
                f"no reply from {where} within {config.timeout_s:g} s", timed_out=True
            ) from None
        except BaseException:
            conn.close()
            raise
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


def _exchange(conn: http.client.HTTPConnection, url: str, body: bytes, headers: dict,
              deadline: float, where: str) -> tuple[http.client.HTTPResponse, bytes]:
    """Send one POST on `conn` and read the whole reply by `deadline`."""
    if conn.sock is None:
        try:
            conn.connect()
        except OSError as exc:  # refused, unreachable, no answer to the handshake, TLS...
            raise TransientError(f"connection to {where} failed: {_reason(exc)}") from None
    sock = conn.sock  # the reply keeps reading it even when http.client lets go of it
    try:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        conn.request("POST", _target(url), body=body, headers=headers)
        resp = conn.getresponse()
        return resp, _read_until(conn, sock, resp, deadline)
    except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
        raise
    except TimeoutError:
        raise
    except (http.client.HTTPException, OSError) as exc:
        raise TransientError(f"connection to {where} failed: {_reason(exc)}") from None


def _read_until(conn: http.client.HTTPConnection, sock, resp: http.client.HTTPResponse,
                deadline: float) -> bytes:
    """The body, at most MAX_REPLY_BYTES + 1 bytes, read piece by piece so that a server
    trickling its reply cannot hold the call past `deadline`; a reply left unread closes the
    connection (the next call opens a fresh one)."""
    parts, size = [], 0
    while size <= MAX_REPLY_BYTES:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        piece = resp.read1(MAX_REPLY_BYTES + 1 - size)
        if not piece:
            if resp.length:  # the server closed before the Content-Length it announced
                raise http.client.IncompleteRead(b"".join(parts), resp.length)
            resp.close()  # done with this reply: the connection can carry the next request
            return b"".join(parts)
        parts.append(piece)
        size += len(piece)
    conn.close()
    return b"".join(parts)


def _reason(exc: BaseException) -> str:
    """The error's class (ConnectionRefusedError...), never the URL again."""
    return type(exc).__name__
