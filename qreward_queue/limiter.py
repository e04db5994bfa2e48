"""The global limiter: one backend's RPM/TPM buckets, concurrency leases and AIMD, kept in Redis.

Why: a backend enforces its limits across all of our callers, while Celery's ``rate_limit`` is per
worker. Every worker process on every machine therefore books its calls here, in atomic Lua
scripts (``qreward_queue/lua/``) clocked by Redis ``TIME`` so that skewed machine clocks do not
matter. A call is booked at its start time, so levels can go below zero: later calls wait behind
that debt (first booked, first served) and a cost above capacity passes after its fair wait.
Keys per backend share one hash tag (one Redis Cluster slot)::

    qrq:{<backend>}:bucket     hash: per limit its level and refill time, learned rates, pause
    qrq:{<backend>}:leases     zset: holder id -> lease expiry (server ms)
    qrq:{<backend>}:aimd       hash: adaptive concurrency limit
    qrq:{<backend>}:recent429  counter of 429s, expires 60 s after the first
"""

from __future__ import annotations

import logging
import math
import random
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, TypeVar

import redis
from redis.commands.core import Script

from .ratelimit_headers import RateLimitHeaders

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_Limit = tuple[str, float, float]  # name, capacity, refill rate per ms
_SCRIPT_KEYS = {  # script -> indexes into _keys(backend)
    "acquire": (0, 1, 2),
    "settle": (0,),
    "feedback": (0, 2, 3),
    "checkpoint": (0, 1),
    "status": (0, 1, 2, 3),
}


def estimate_tokens(text: str, max_output_tokens: int = 0) -> int:
    """TPM cost to book before a call, as providers count it: ~4 characters a token + output cap."""
    return math.ceil(len(text) / 4) + max_output_tokens


class LimiterBusy(Exception):
    """The call cannot start within ``max_wait_s``: retry the task after ``wait_s`` instead."""

    def __init__(self, wait_s: float, reason: str) -> None:
        super().__init__(f"limiter busy ({reason}): next start in {wait_s:.3f} s")
        self.wait_s = wait_s
        self.reason = reason


def _keys(backend: str) -> tuple[str, str, str, str]:
    tag = f"qrq:{{{backend}}}"
    return f"{tag}:bucket", f"{tag}:leases", f"{tag}:aimd", f"{tag}:recent429"


def _load_scripts(client: redis.Redis) -> dict[str, Script]:
    """EVALSHA handles for every script, each prefixed with the shared ``lib.lua``."""
    lua = resources.files("qreward_queue") / "lua"
    lib = (lua / "lib.lua").read_text()
    return {name: client.register_script(lib + (lua / f"{name}.lua").read_text())
            for name in _SCRIPT_KEYS}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _limit_args(limits: Sequence[_Limit], extra: Mapping[str, Sequence[Any]]) -> list[Any]:
    """The ``n, then per limit: name, capacity, rate, *extra`` tail that every script takes."""
    args: list[Any] = [len(limits)]
    for name, cap, rate in limits:
        args += [name, cap, rate, *extra.get(name, ())]
    return args


@dataclass
class Grant:
    """A call the limiter let through; its lease is held until the ``with`` block ends."""

    holder: str
    wait_s: float
    tokens: float
    _limiter: Limiter = field(repr=False)
    _shift_ms: float = field(repr=False)  # the pause shift it was booked under

    def settle(self, actual_tokens: float) -> None:
        """Reconcile the booked TPM estimate with the call's real usage (no-op without tpm)."""
        self._limiter._settle_tokens(self.tokens - actual_tokens)
        self.tokens = actual_tokens


class Limiter:
    """Books calls to one backend under its global RPM, TPM and concurrency limits.

    Parameters: ``rpm``/``tpm``/``max_concurrent`` (None or 0 = no such limit),
    ``burst_s`` (each bucket holds this many seconds of refill, at least one unit),
    ``lease_ttl_s`` (a dead holder's lease lapses after this; keep it above the call timeout),
    ``outage_wait_s`` (how long every call waits out an unreachable Redis before raising, on top
    of the client's own retries),
    ``aimd_cooldown_s`` (at most one multiplicative decrease per this many seconds).

    >>> import fakeredis
    >>> limiter = Limiter(fakeredis.FakeRedis(), "judge-a", rpm=600, tpm=60_000, max_concurrent=4)
    >>> with limiter.acquire(tokens=estimate_tokens("Is 2+2=4? Answer yes or no.", 16)) as grant:
    ...     grant.settle(actual_tokens=20)  # after the call: its real usage
    >>> limiter.feedback(200, {"x-ratelimit-remaining-requests": "99"})
    >>> limiter.status()["leases_in_use"], limiter.status()["adaptive_limit"]
    (0, 4)
    """

    def __init__(
        self,
        redis_client: redis.Redis,
        backend: str,
        rpm: float | None = None,
        tpm: float | None = None,
        max_concurrent: int | None = None,
        burst_s: float = 1.0,
        lease_ttl_s: float = 60.0,
        outage_wait_s: float = 120.0,
        aimd_cooldown_s: float = 1.0,
    ) -> None:
        if burst_s <= 0 or lease_ttl_s <= 0 or min(rpm or 0, tpm or 0, max_concurrent or 0) < 0:
            raise ValueError("burst_s and lease_ttl_s must be positive, limits not negative")
        self.backend = backend
        self.max_concurrent = max_concurrent or 0
        self.lease_ttl_s = lease_ttl_s
        self.outage_wait_s = outage_wait_s
        self.aimd_cooldown_s = aimd_cooldown_s
        self._redis = redis_client
        self._keys = _keys(backend)
        self._scripts = _load_scripts(redis_client)
        self._limits: list[_Limit] = [
            (name, max(per_min / 60.0 * burst_s, 1.0), per_min / 60_000.0)
            for name, per_min in (("rpm", rpm), ("tpm", tpm))
            if per_min
        ]

    @contextmanager
    def acquire(self, tokens: float = 0, max_wait_s: float = 30.0) -> Iterator[Grant]:
        """Hold a lease and the costs (1 request, ``tokens``) for the ``with`` block.

        Sleeps the granted wait first; polls (with jitter) while no lease is free. Raises
        `LimiterBusy` when the call could not start within ``max_wait_s``.
        """
        grant = self._reserve(tokens, max_wait_s)
        try:
            self._wait_for_start(grant)
            yield grant
        finally:
            self._retry(self._redis.zrem, self._keys[1], grant.holder)

    def feedback(self, status_code: int | None, headers: Mapping[str, str] | None = None,
                 timed_out: bool = False) -> None:
        """Teach the limiter what the backend answered: headers, 429 pauses, AIMD events.

        A 429 pauses the backend for everyone for Retry-After (else the reset of an exhausted
        limit, else 1 s); 429s and timeouts halve the adaptive concurrency, successes grow it.
        """
        h = RateLimitHeaders.from_headers(headers)
        ok = status_code is not None and 200 <= status_code < 300
        event = "timeout" if timed_out else "429" if status_code == 429 else "ok" if ok else ""
        pause_s = 0.0
        if event == "429":
            exhausted = [reset for reset, left in ((h.reset_requests_s, h.remaining_requests),
                                                   (h.reset_tokens_s, h.remaining_tokens))
                         if reset is not None and not left]
            pause_s = max(exhausted, default=1.0) if h.retry_after_s is None else h.retry_after_s
        self._feedback(event, pause_s, h)

    def pause(self, seconds: float) -> None:
        """Stop every worker of this backend for ``seconds`` (booked calls move back with it)."""
        self._feedback("", seconds, RateLimitHeaders())

    def status(self) -> dict[str, Any]:
        """Levels refilled to now (nothing written), rates, leases, adaptive limit, 429s, pause."""
        result = self._run("status", *_limit_args(self._limits, {}))
        return _parse_status(self.backend, self.max_concurrent, result)

    def _reserve(self, tokens: float, max_wait_s: float) -> Grant:
        holder = uuid.uuid4().hex
        costs = {"rpm": [1], "tpm": [tokens]}
        deadline = time.monotonic() + max_wait_s
        while True:
            budget_ms = max(0.0, deadline - time.monotonic()) * 1000
            granted, wait_ms, reason, shift = map(_text, self._run(
                "acquire", holder, self.lease_ttl_s * 1000, self.max_concurrent, budget_ms,
                *_limit_args(self._limits, costs)))
            wait_s = float(wait_ms) / 1000
            if granted == "1":
                return Grant(holder, wait_s, tokens, self, float(shift))
            if reason != "lease" or time.monotonic() + wait_s > deadline:
                raise LimiterBusy(wait_s, reason)
            time.sleep(wait_s * random.uniform(0.5, 1.5))

    def _wait_for_start(self, grant: Grant) -> None:
        """Sleep the booked wait, plus any pause that was ordered meanwhile."""
        if grant.wait_s <= 0:
            return
        time.sleep(grant.wait_s)
        seen = grant._shift_ms
        while True:
            seen, extra_ms = map(float, map(_text, self._run(
                "checkpoint", grant.holder, self.lease_ttl_s * 1000, seen)))
            if extra_ms <= 0:
                return
            time.sleep(extra_ms / 1000)

    def _settle_tokens(self, delta: float) -> None:
        if delta and any(name == "tpm" for name, _, _ in self._limits):
            self._run("settle", *_limit_args(self._limits, {"rpm": [0], "tpm": [delta]}))

    def _feedback(self, event: str, pause_s: float, h: RateLimitHeaders) -> None:
        def opt(value: float | None, scale: float) -> float | str:
            return "" if value is None else value * scale

        headers = {
            "rpm": [opt(h.remaining_requests, 1), opt(h.limit_requests, 1 / 60_000),
                    opt(h.reset_requests_s, 1000)],
            "tpm": [opt(h.remaining_tokens, 1), opt(h.limit_tokens, 1 / 60_000),
                    opt(h.reset_tokens_s, 1000)],
        }
        self._run("feedback", event, self.max_concurrent, self.aimd_cooldown_s * 1000,
                  pause_s * 1000, *_limit_args(self._limits, headers))

    def _run(self, script: str, *args: Any) -> Any:
        keys = [self._keys[i] for i in _SCRIPT_KEYS[script]]
        return self._retry(self._scripts[script], keys=keys, args=list(args))

    def _retry(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Call Redis, waiting out an outage (restart, failover) for up to ``outage_wait_s``."""
        deadline = time.monotonic() + self.outage_wait_s
        delay = 0.05
        while True:
            try:
                return fn(*args, **kwargs)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                log.warning("limiter %s: Redis unavailable (%s), retrying for up to %.0f s",
                            self.backend, exc, left)
                time.sleep(min(delay * random.uniform(0.8, 1.2), left))
                delay = min(delay * 2, 1.0)


def _parse_status(backend: str, max_concurrent: int, result: Sequence[Any]) -> dict[str, Any]:
    values = [_text(v) for v in result]
    leases, adaptive, recent_429s, paused_ms = values[:4]
    limits = {}
    for i in range(4, len(values), 6):
        name, level, cap, rate, cfg_rate, reset_ms = values[i:i + 6]
        limits[name] = {
            "level": float(level),
            "capacity": float(cap),
            "per_minute": float(rate) * 60_000,
            "configured_per_minute": float(cfg_rate) * 60_000,
            "reset_in_s": float(reset_ms) / 1000 if reset_ms else None,
        }
    return {
        "backend": backend,
        "limits": limits,
        "leases_in_use": int(leases),
        "max_concurrent": max_concurrent or None,
        "adaptive_limit": int(float(adaptive)) if adaptive else None,
        "recent_429s": int(recent_429s),
        "paused_for_s": float(paused_ms) / 1000,
    }
