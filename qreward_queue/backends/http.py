"""Pooled HTTP for the judge and reward-model backends, and the classification of replies.

One `requests.Session` per thread and backend (Session thread-safety was never documented),
created lazily so prefork children build their own after the fork. urllib3 retries stay off:
qrq's retry policy decides.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import requests
import urllib3
from requests.adapters import HTTPAdapter

from ..config import Backend, redact_url
from ..errors import PermanentError, RateLimited, TransientError
from ..ratelimit_headers import parse_retry_after

MAX_REPLY_BYTES = 8 << 20
_local = threading.local()


@dataclass
class Reply:
    status_code: int
    headers: dict[str, str]
    body: Any


def session_for(backend: str) -> requests.Session:
    """This thread's session for `backend`, kept open so connections are reused."""
    sessions = getattr(_local, "sessions", None)
    if sessions is None:
        sessions = _local.sessions = {}
    if backend not in sessions:
        session = requests.Session()
        adapter = HTTPAdapter(pool_connections=1, pool_maxsize=2, max_retries=0)
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        sessions[backend] = session
    return sessions[backend]


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
    try:
        resp = session_for(config.name).post(
            url,
            json=payload,
            headers=headers,
            timeout=(min(5.0, config.timeout_s), config.timeout_s),
            stream=True,
        )
        raw = resp.raw.read(MAX_REPLY_BYTES + 1, decode_content=True)
        resp.close()
    except (requests.Timeout, urllib3.exceptions.ReadTimeoutError):
        raise TransientError(f"no reply within {config.timeout_s:g} s", timed_out=True) from None
    except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
        raise TransientError(f"connection failed: {redact_url(url)} ({type(exc).__name__})") \
            from None
    reply_headers = {k.lower(): v for k, v in resp.headers.items()}
    facts = {"status_code": resp.status_code, "headers": reply_headers}
    text = raw[:500].decode("utf-8", "replace")
    if resp.status_code == 429:
        raise RateLimited(
            "rate limited (429)", text, retry_after_s=_retry_after(reply_headers), **facts
        )
    if resp.status_code >= 500:
        raise TransientError(f"server error {resp.status_code}", text, **facts)
    if resp.status_code >= 400:
        raise PermanentError(f"request rejected with {resp.status_code}", text, **facts)
    if len(raw) > MAX_REPLY_BYTES:
        raise PermanentError(f"reply larger than {MAX_REPLY_BYTES} bytes", **facts)
    try:
        body = json.loads(raw)
    except ValueError:
        raise PermanentError("reply is not JSON", text, **facts) from None
    return Reply(resp.status_code, reply_headers, body)


def _retry_after(headers: dict[str, str]) -> float | None:
    """The 429's Retry-After in seconds; None when absent or unreadable."""
    value = headers.get("retry-after")
    try:
        return parse_retry_after(value) if value else None
    except ValueError:
        return None
