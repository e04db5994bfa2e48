"""Pooled HTTP for the judge and reward-model backends, and the classification of replies.

urllib3 directly, one thread-safe `PoolManager` per backend and process (built lazily, so
prefork children build their own after the fork): keep-alive connections, no per-call
environment or proxy lookups (what `requests` does on every call), no retries of its own
(qrq's retry policy decides) and no redirects (a 3xx is an error naming where it pointed:
prompts are never re-sent elsewhere). Every call ends by `timeout_s` in total, however slowly
the server trickles its reply.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import urllib3

from ..config import Backend, redact_url
from ..errors import PermanentError, RateLimited, TransientError
from ..ratelimit_headers import RateLimitHeaders

MAX_REPLY_BYTES = 8 << 20
_pools: dict[str, urllib3.PoolManager] = {}
_lock = threading.Lock()
os.register_at_fork(after_in_child=_pools.clear)


@dataclass
class Reply:
    status_code: int
    headers: dict[str, str]
    body: Any


def pool_for(config: Backend) -> urllib3.PoolManager:
    """This process's connection pool for the backend, sized to its calls in flight."""
    with _lock:
        if config.name not in _pools:
            _pools[config.name] = urllib3.PoolManager(
                num_pools=4, maxsize=config.pool.calls, block=False, retries=False
            )
        return _pools[config.name]


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
    deadline = time.monotonic() + config.timeout_s
    try:
        resp = pool_for(config).request(
            "POST",
            url,
            body=json.dumps(payload).encode(),
            headers=headers,
            timeout=urllib3.Timeout(connect=min(5.0, config.timeout_s), read=config.timeout_s),
            redirect=False,
            preload_content=False,
        )
        try:
            raw = _read_until(resp, deadline)
        finally:
            resp.release_conn()
    except urllib3.exceptions.NewConnectionError as exc:  # (a subclass of the timeout error)
        raise TransientError(f"connection to {where} failed: {_reason(exc)}") from None
    except (TimeoutError, urllib3.exceptions.TimeoutError):
        raise TransientError(
            f"no reply from {where} within {config.timeout_s:g} s", timed_out=True
        ) from None
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise TransientError(f"connection to {where} failed: {_reason(exc)}") from None
    reply_headers = {k.lower(): v for k, v in resp.headers.items()}
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


def _read_until(resp: urllib3.BaseHTTPResponse, deadline: float) -> bytes:
    """The body, at most MAX_REPLY_BYTES + 1 bytes, read piece by piece so that a server
    trickling its reply cannot hold the call past `deadline`."""
    parts, size = [], 0
    while size <= MAX_REPLY_BYTES:
        if time.monotonic() > deadline:
            raise TimeoutError
        piece = resp.read1(MAX_REPLY_BYTES + 1 - size)
        if not piece:
            break
        parts.append(piece)
        size += len(piece)
    return b"".join(parts)


def _reason(exc: Exception) -> str:
    """The underlying cause's class (ConnectionRefusedError...), never the URL again."""
    cause = exc
    while isinstance(cause, urllib3.exceptions.HTTPError) and cause.__context__ is not None:
        cause = cause.__context__
    return type(cause).__name__
