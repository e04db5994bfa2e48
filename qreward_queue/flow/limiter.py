"""The global limiter: one backend's RPM/TPM buckets, concurrency leases and AIMD, kept in Redis.

Why: a backend enforces its limits across all of our callers, while Celery's ``rate_limit`` is per
worker. Every worker process on every machine therefore books its calls here, in atomic Lua
scripts (``qreward_queue/flow/lua/``) clocked by Redis ``TIME`` so that skewed machine clocks do not
matter. A call is booked at its start time, so levels can go below zero: later calls wait behind
that debt (first booked, first served) and a cost above capacity passes after its fair wait.

A call costs two round trips in the common case: its booking (``reserve`` can grant several
calls at once) and its grant's ``release`` with what the reply taught (reconcile tokens, learn
from the reply, free the lease). Python and Lua exchange named fields as JSON. Key names:
``keys.limiter``.

One implementation, two faces: each operation (book, wait for the booked start, release) is a
generator of the Redis round trips, sleeps and blocking waits it needs (`_Eval`, `_Sleep`,
`_Block`); `_drive` carries them out with the blocking client for a thread, `_drive_async`
with redis-py's asyncio client on the worker's call loop (the same Lua scripts), so a call on
the loop pays no thread switch for its grant.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, TypeVar

import redis
import redis.asyncio

from .. import keys
from ..errors import LimiterBusy
from .ratelimit_headers import DEFAULT_MAX_PAUSE_S, NO_FEEDBACK, NOTHING_TOLD, Feedback

log = logging.getLogger(__name__)

_T = TypeVar("_T")
MAX_PENDING = 32  # finishes sent together at most
LOOP_FINISH_DELAY_S = 0.02  # on the call loop, successes telling nothing go together within this
MIN_BLOCK_S = 0.002  # the shortest wait for a released lease
CORROBORATE = 3  # replies that must agree before a limit below the configured one is believed
CLAIM_WINDOW_S = 60.0  # ... each within this long of the one before (or a 429 saying it)
_SCRIPT_KEYS = {  # script -> the limiter keys it touches, in KEYS order
    "acquire": ("bucket", "leases", "aimd", "released"),
    "checkpoint": ("bucket", "leases"),
    "finish": ("bucket", "leases", "aimd", "recent429", "released"),
    "status": ("bucket", "leases", "aimd", "recent429"),
}


def estimate_tokens(text: str, max_output_tokens: int = 0) -> int:
    """TPM cost to book before a call, as providers count it: ~4 characters a token + output cap."""
    return math.ceil(len(text) / 4) + max_output_tokens


def _load_scripts(client: Any) -> dict[str, Any]:
    """EVALSHA handles for every script on `client` (blocking or asyncio), each prefixed with
    the shared ``lib.lua`` and without comments (the embedded mode's fakeredis compiles the
    text on every call)."""
    lua = resources.files("qreward_queue.flow") / "lua"
    lib = (lua / "lib.lua").read_text()
    return {name: client.register_script(_code(lib + (lua / f"{name}.lua").read_text()))
            for name in _SCRIPT_KEYS}


@dataclass(frozen=True)
class _Eval:
    """Run limiter script `script` with `args`; the step gets its decoded reply."""

    script: str
    args: dict[str, Any]


@dataclass(frozen=True)
class _Sleep:
    seconds: float


@dataclass(frozen=True)
class _Block:
    """Wait up to `seconds` for a lease released anywhere (finish.lua announces each one)."""

    seconds: float


_Steps = Generator[_Eval | _Sleep | _Block, Any, _T]


class _Outage:
    """How long to wait before the next try while Redis is away (restart, failover), for up
    to `wait_s` in all; then the error stands."""

    def __init__(self, backend: str, wait_s: float):
        self.backend, self.deadline, self.delay = backend, time.monotonic() + wait_s, 0.05

    def next_delay(self, exc: Exception) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise exc
        log.warning("limiter %s: Redis unavailable (%s), retrying for up to %.0f s",
                    self.backend, exc, left)
        delay = min(self.delay * random.uniform(0.8, 1.2), left)
        self.delay = min(self.delay * 2, 1.0)
        return delay


_REDIS_AWAY = (redis.ConnectionError, redis.TimeoutError)


def _code(lua: str) -> str:
    """Lua without comment lines, trailing comments and blank lines (our scripts hold no
    '--' inside a string)."""
    lines = (line.split("--", 1)[0].rstrip() for line in lua.splitlines())
    return "\n".join(line for line in lines if line)


def _as_list(value: Any) -> list:
    """cjson encodes an empty Lua table as ``{}``."""
    return value if isinstance(value, list) else []


@dataclass(frozen=True)
class Reading:
    """What the limiter made of one reply. `pause_s`: the pause it ordered for every caller
    (0: none). `flow_control`: a 429 the limiter acted on (a shared pause, or a cut of the
    adaptive concurrency for a congested backend); it sets the pace, so the refused call waits
    its turn instead of spending one of its `[retry] attempts` (see
    `[retry] rate_limited_per_attempt`)."""

    pause_s: float = 0.0
    flow_control: bool = False


@dataclass
class Grant:
    """A call the limiter let through: its lease is held until ``release`` (or the ``with`` end)."""

    holder: str
    wait_s: float
    tokens: float
    _limiter: Limiter = field(repr=False)
    _shift_ms: float = field(repr=False)  # the pause shift it was booked under
    released: bool = field(default=False, repr=False)

    def wait(self) -> None:
        """Sleep until the booked start, plus any pause that was ordered meanwhile."""
        if self.wait_s > 0:
            self._limiter._drive(self._limiter._wait_for_start(self))

    async def wait_async(self) -> None:
        """`wait` on an event loop."""
        if self.wait_s > 0:
            await self._limiter._drive_async(self._limiter._wait_for_start(self))

    def release(self, feedback: Feedback) -> Reading:
        """End the call in one round trip: reconcile its booked tokens with those `feedback`
        reports, learn from its reply (see `Limiter._finish`), release the lease. `feedback`
        is what the backend's kind read from the reply (`BackendClient.feedback`), or
        `NO_FEEDBACK` for a call not made. A grant released before stays released."""
        return self._limiter._drive(self._release(feedback, self._limiter.finish_delay_s))

    async def release_async(self, feedback: Feedback) -> Reading:
        """`release` on the call loop: a success that told nothing of the limits waits up to
        LOOP_FINISH_DELAY_S to be sent with others (one script for many calls)."""
        limiter = self._limiter
        return await limiter._finish_async(self._release(feedback, limiter.loop_finish_delay_s))

    def _release(self, feedback: Feedback, delay_s: float) -> _Steps[Reading]:
        if self.released:
            return Reading()
        self.released = True
        refund = 0.0 if feedback.tokens is None else self.tokens - feedback.tokens
        return (yield from self._limiter._finish(self.holder, feedback, refund, delay_s))


_giving_back: set[asyncio.Task[Reading]] = set()  # releases under way (a task needs an owner)


def _given_back(booking: asyncio.Future[list[Grant]]) -> None:
    """The grants of a booking whose caller is gone, released unused (on the loop)."""
    if booking.cancelled() or booking.exception() is not None:
        return
    for grant in booking.result():
        task = asyncio.ensure_future(grant.release_async(NO_FEEDBACK))
        _giving_back.add(task)
        task.add_done_callback(_giving_back.discard)


class Limiter:
    """Books calls to one backend under its global RPM, TPM and concurrency limits.

    Parameters: ``rpm``/``tpm``/``max_concurrent`` (None or 0 = no such limit),
    ``burst_s`` (each bucket holds this many seconds of refill, at least one unit),
    ``lease_ttl_s`` (a dead holder's lease lapses after this; keep it above the call timeout),
    ``outage_wait_s`` (how long every call waits out an unreachable Redis before raising, on top
    of the client's own retries),
    ``aimd_cooldown_s`` (at most one multiplicative decrease per this many seconds),
    ``max_pause_s`` (the longest pause one reply can order; see `RateLimitHeaders`),
    ``finish_delay_s`` (successes may wait this long to be finished together; 0: at once),
    ``learned_relax_s`` (a limit learned from replies, below the configured one, doubles back
    this often unless replies confirm it; see ``lua/finish.lua`` for when one is believed),
    ``connect_async`` (makes the asyncio client of the same Redis for the ``*_async`` face, on
    the loop that uses it; without it that face runs the blocking client on a thread).

    >>> import fakeredis
    >>> limiter = Limiter(fakeredis.FakeRedis(), "judge-a", rpm=600, tpm=60_000, max_concurrent=4)
    >>> with limiter.acquire(tokens=estimate_tokens("Is 2+2=4? Answer yes or no.", 16)) as grant:
    ...     # after the call: what its reply taught, its real usage among it
    ...     reply = Feedback.from_http(200, {"x-ratelimit-remaining-requests": "99"}, tokens=20)
    ...     reading = grant.release(reply)
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
        max_pause_s: float = DEFAULT_MAX_PAUSE_S,
        finish_delay_s: float = 0.0,
        learned_relax_s: float = 60.0,
        connect_async: Callable[[], redis.asyncio.Redis] | None = None,
    ) -> None:
        if burst_s <= 0 or lease_ttl_s <= 0 or min(rpm or 0, tpm or 0, max_concurrent or 0) < 0:
            raise ValueError("burst_s and lease_ttl_s must be positive, limits not negative")
        self.backend = backend
        self.max_concurrent = max_concurrent or 0
        self.lease_ttl_s = lease_ttl_s
        self.outage_wait_s = outage_wait_s
        self.aimd_cooldown_s = aimd_cooldown_s
        self.max_pause_s = max_pause_s
        self.bounded: tuple[str, ...] = ()  # the bounds the last bounded reply hit
        self.finish_delay_s = finish_delay_s
        self.learned_relax_s = learned_relax_s
        self._pending: list[dict[str, Any]] = []  # finishes of successes not sent yet
        self._pending_since = 0.0
        self._lock = threading.Lock()
        self._redis = redis_client
        self._keys = keys.limiter(backend)
        self._scripts = _load_scripts(redis_client)
        self._connect_async = connect_async
        self._aio: tuple[redis.asyncio.Redis, dict[str, Any]] | None = None
        self._flush_scheduled = False
        self._limits: list[dict[str, Any]] = [
            {"name": name, "cap": max(per_min / 60.0 * burst_s, 1.0), "rate": per_min / 60_000.0}
            for name, per_min in (("rpm", rpm), ("tpm", tpm))
            if per_min
        ]

    @contextmanager
    def acquire(self, tokens: float = 0, max_wait_s: float = 30.0) -> Iterator[Grant]:
        """Hold a lease and the costs (1 request, ``tokens``) for the ``with`` block.

        Sleeps the granted wait first; polls (with jitter) while no lease is free. Raises
        `LimiterBusy` when the call could not start within ``max_wait_s``. The block ends the
        call with ``grant.release(feedback)``; a block left without it (an exception) releases
        the lease with nothing learned.
        """
        (grant,) = self.reserve(1, tokens, max_wait_s)
        try:
            grant.wait()
            yield grant
        finally:
            grant.release(NO_FEEDBACK)

    def reserve(self, count: int, tokens: float = 0, max_wait_s: float = 30.0) -> list[Grant]:
        """Book up to ``count`` calls of ``tokens`` each in one round trip; at least one.

        Fewer come back when leases run out. Each grant must be waited (``grant.wait()``) and
        released (``grant.release(feedback)``). While no lease is free it blocks until one is
        released by any process (finish.lua announces each release); raises `LimiterBusy` when
        not even one call could start within ``max_wait_s``.
        """
        # leases this process released are free before it books more
        return self._drive(self._reserve(count, tokens, max_wait_s, flush_first=True))

    async def reserve_async(self, count: int, tokens: float = 0,
                            max_wait_s: float = 30.0) -> list[Grant]:
        """`reserve` on an event loop; the finishes held back go at their own time (within
        LOOP_FINISH_DELAY_S), so that one script carries many calls' finishes.

        A caller cancelled while it books (an abandoned hedge) leaves no lease behind: the
        booking ends in its own time and what it booked is released unused."""
        booking = asyncio.ensure_future(
            self._drive_async(self._reserve(count, tokens, max_wait_s, False)))
        try:
            return await asyncio.shield(booking)
        except asyncio.CancelledError:
            booking.add_done_callback(_given_back)
            raise

    def _reserve(self, count: int, tokens: float, max_wait_s: float,
                 flush_first: bool) -> _Steps[list[Grant]]:
        if flush_first:
            yield from self._flush()
        prefix = uuid.uuid4().hex
        deadline = time.monotonic() + max_wait_s
        limits = [dict(lim, cost=1 if lim["name"] == "rpm" else tokens) for lim in self._limits]
        while True:
            budget_ms = max(0.0, deadline - time.monotonic()) * 1000
            reply = yield _Eval("acquire", dict(
                holder=prefix, count=count, limits=limits, lease_ttl_ms=self.lease_ttl_s * 1000,
                max_concurrent=self.max_concurrent, max_wait_ms=budget_ms))
            waits = _as_list(reply["waits"])
            if waits:
                return [Grant(f"{prefix}:{k}", w / 1000, tokens, self, float(reply["shift"]))
                        for k, w in enumerate(waits, start=1)]
            wait_s = reply["wait_ms"] / 1000
            if reply["reason"] != "lease" or time.monotonic() + wait_s > deadline:
                raise LimiterBusy(wait_s, reply["reason"])
            # until a lease is released anywhere, or a lapsed one is found by the next try: a
            # waiter in another process takes a freed lease within a round trip, not a poll later
            yield _Block(wait_s * random.uniform(0.5, 1.5))

    async def _finish_async(self, steps: _Steps[Reading]) -> Reading:
        reading = await self._drive_async(steps)
        if self._pending and not self._flush_scheduled:  # successes held back: sent soon
            self._flush_scheduled = True
            loop = asyncio.get_running_loop()
            loop.call_later(self.loop_finish_delay_s,
                            lambda: loop.create_task(self._flush_later()))
        return reading

    async def _flush_later(self) -> None:
        """The finishes held back, sent soon after. A process that is exiting refuses its
        executors new work (an embedded store's flush runs on one): its leases then lapse."""
        try:
            await self.flush_async()
        except RuntimeError as exc:
            if "after shutdown" not in str(exc):
                raise

    def pause(self, seconds: float) -> None:
        """Stop every worker of this backend for ``seconds`` (at most ``max_pause_s``)."""
        self.flush(min(seconds, self.max_pause_s))

    def status(self) -> dict[str, Any]:
        """Levels refilled to now (nothing written), rates, leases, adaptive limit, 429s, pause."""
        s = self._drive(self._eval("status", limits=self._limits))
        return {
            "backend": self.backend,
            "limits": {
                lim["name"]: {
                    "level": lim["level"],
                    "capacity": lim["cap"],
                    "per_minute": lim["rate"] * 60_000,
                    "configured_per_minute": lim["cfg_rate"] * 60_000,
                    "reset_in_s": lim["reset_ms"] / 1000 if "reset_ms" in lim else None,
                    "learned": _learned(lim),
                }
                for lim in _as_list(s["limits"])
            },
            "leases_in_use": int(s["leases"]),
            "max_concurrent": self.max_concurrent or None,
            "adaptive_limit": int(s["adaptive_limit"]) if "adaptive_limit" in s else None,
            "adaptive_why": s.get("adaptive_why"),  # its last move (or not) and why
            "recent_429s": int(s["recent_429s"]),
            "paused_for_s": s["paused_ms"] / 1000,
            "bounded": s.get("bounded") or None,  # the last out-of-bounds reply, if recent
        }

    def _wait_for_start(self, grant: Grant) -> _Steps[None]:
        yield _Sleep(grant.wait_s)
        seen = grant._shift_ms
        while True:
            reply = yield _Eval("checkpoint", dict(holder=grant.holder, seen_shift=seen,
                                                   lease_ttl_ms=self.lease_ttl_s * 1000))
            seen, extra_ms = reply["shift"], reply["extra_ms"]
            if extra_ms <= 0:
                return
            yield _Sleep(extra_ms / 1000)

    @property
    def loop_finish_delay_s(self) -> float:
        return max(self.finish_delay_s, LOOP_FINISH_DELAY_S)

    def _finish(self, holder: str, feedback: Feedback, refund: float,
                delay_s: float) -> _Steps[Reading]:
        """A 429 of an exhausted rate pauses the backend for everyone for Retry-After (else the
        reset of the exhausted limit; without either, no one: each call backs off with
        jitter). A 429 while the headers say requests and tokens are left is congestion (a
        concurrency limit below the configured one): it cuts the adaptive concurrency (as
        timeouts on a share of recent calls do; see finish.lua), and pauses no one. A 429 that
        says neither cuts the concurrency and pauses only for a usable Retry-After. Successes
        grow the concurrency. Returns what it made of the reply.

        Successes whose replies said nothing of the limits (a self-hosted judge's) may wait up
        to `delay_s` to be sent together (on the call loop, where one script then carries many
        calls; in embedded mode, where every script costs interpreter time); anything else,
        limits told included, is sent at once, with them.
        """
        h = feedback.told
        if h.bounded:
            self.bounded = h.bounded
            log.warning("backend %s: reply out of bounds: %s", self.backend, "; ".join(h.bounded))
        event = "timeout" if feedback.timed_out else "ok" if feedback.answered else ""
        pause_s = 0.0
        if feedback.rate_limited and h.rate_left():
            event = "congested"  # too many calls in flight: cut concurrency, pause no one
        elif feedback.rate_limited:  # exhausted: pause everyone; unknown why: also cut
            event = "exhausted" if 0 in (h.remaining_requests, h.remaining_tokens) else "429"
            pause_s = h.pause_s()
        call: dict[str, Any] = {"holder": holder, "event": event, "told": {}}
        says_limits = h != NOTHING_TOLD
        told = {
            "rpm": (h.remaining_requests, h.limit_requests, h.reset_requests_s, 0.0),
            "tpm": (h.remaining_tokens, h.limit_tokens, h.reset_tokens_s, refund),
        } if refund or says_limits else {}
        for lim in self._limits if told else ():
            remaining, per_min, reset_s, lim_refund = told[lim["name"]]
            entry = {name: value for name, value in (
                ("refund", lim_refund), ("remaining", remaining),
                ("reset_ms", _scaled(reset_s, 1000)), ("limit_rate", _scaled(per_min, 1 / 60_000)),
            ) if value is not None and (value or name != "refund")}
            if entry:
                call["told"][lim["name"]] = entry
        with self._lock:
            now = time.monotonic()
            self._pending.append(call)
            if len(self._pending) == 1:  # the first held back since the last flush
                self._pending_since = now
            due = (event != "ok" or says_limits or not delay_s
                   or len(self._pending) >= MAX_PENDING or now - self._pending_since >= delay_s)
        if due:
            yield from self._flush(pause_s, "; ".join(h.bounded))
        cut = event == "congested" and self.max_concurrent > 0
        return Reading(pause_s, feedback.rate_limited and (pause_s > 0 or cut))

    def flush(self, pause_s: float = 0.0, bounded: str = "") -> None:
        """Send the finishes waiting in this process (releasing their leases) in one script."""
        self._drive(self._flush(pause_s, bounded))

    async def flush_async(self) -> None:
        """`flush` on the call loop."""
        self._flush_scheduled = False
        await self._drive_async(self._flush())

    def _flush(self, pause_s: float = 0.0, bounded: str = "") -> _Steps[None]:
        with self._lock:
            calls, self._pending = self._pending, []
        if calls or pause_s:
            yield from self._eval(
                "finish", calls=calls, limits=self._limits, pause_ms=pause_s * 1000,
                max_concurrent=self.max_concurrent, bounded=bounded,
                aimd_cooldown_ms=self.aimd_cooldown_s * 1000, corroborate=CORROBORATE,
                claim_window_ms=CLAIM_WINDOW_S * 1000)

    def _eval(self, script: str, **args: Any) -> _Steps[dict[str, Any]]:
        return (yield _Eval(script, args))

    # -- the two drivers: one for a thread, one for an event loop --------------------------

    def _drive(self, steps: _Steps[_T]) -> _T:
        """Carry out `steps` with the blocking client (an outage waited out for up to
        ``outage_wait_s``)."""
        reply: Any = None
        try:
            while True:
                step = steps.send(reply)
                if isinstance(step, _Sleep):
                    time.sleep(step.seconds)
                    reply = None
                    continue
                outage = _Outage(self.backend, self.outage_wait_s)
                while True:
                    try:
                        reply = self._io(step)
                        break
                    except _REDIS_AWAY as exc:
                        time.sleep(outage.next_delay(exc))
        except StopIteration as done:
            return done.value

    async def _drive_async(self, steps: _Steps[_T]) -> _T:
        """`_drive` on an event loop: redis-py's asyncio client runs the same scripts (without
        one, the blocking client on a thread of the loop's)."""
        if self._connect_async is None:
            return await asyncio.to_thread(self._drive, steps)
        reply: Any = None
        try:
            while True:
                step = steps.send(reply)
                if isinstance(step, _Sleep):
                    await asyncio.sleep(step.seconds)
                    reply = None
                    continue
                outage = _Outage(self.backend, self.outage_wait_s)
                while True:
                    try:
                        reply = await self._io_async(step)
                        break
                    except _REDIS_AWAY as exc:
                        await asyncio.sleep(outage.next_delay(exc))
        except StopIteration as done:
            return done.value

    def _io(self, step: _Eval | _Block) -> Any:
        if isinstance(step, _Block):  # BLPOP's timeout is whole ms; 0 would block for ever
            return self._redis.blpop([self._keys["released"]], timeout=_block_s(step))
        return json.loads(self._scripts[step.script](**self._script_call(step)))

    async def _io_async(self, step: _Eval | _Block) -> Any:
        if self._aio is None:  # made on the loop that uses it
            assert self._connect_async is not None
            client = self._connect_async()
            self._aio = client, _load_scripts(client)
        client, scripts = self._aio
        if isinstance(step, _Block):
            return await client.blpop([self._keys["released"]], timeout=_block_s(step))
        return json.loads(await scripts[step.script](**self._script_call(step)))

    def _script_call(self, step: _Eval) -> dict[str, Any]:
        args = dict(step.args, relax_ms=self.learned_relax_s * 1000)
        return {"keys": [self._keys[name] for name in _SCRIPT_KEYS[step.script]],
                "args": [json.dumps(args)]}


def _block_s(step: _Block) -> float:
    return round(max(MIN_BLOCK_S, step.seconds), 3)


def _learned(lim: dict[str, Any]) -> dict[str, Any] | None:
    """What replies said of a limit below the configured one (per minute): believed (and
    why, and how long ago) or only claimed so far; None when they said nothing of the kind."""
    if "told_rate" not in lim and "claims" not in lim:
        return None
    return {
        "believed": "told_rate" in lim,
        "told_per_minute": lim.get("told_rate", lim.get("claim_rate", 0)) * 60_000,
        "by": {"429": "a 429", "replies": "agreeing replies"}.get(lim.get("told_by", "")),
        "age_s": lim.get("told_age_ms", lim.get("claim_age_ms", 0)) / 1000,
        "replies": int(lim.get("claims", 0)),
    }


def _scaled(value: float | None, scale: float) -> float | None:
    return None if value is None else value * scale
