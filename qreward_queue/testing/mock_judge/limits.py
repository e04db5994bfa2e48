"""Admission: the rate-limit buckets, the concurrency cap, the latency and fault draws and the
counters, shared by all handler threads behind one lock, so every limit is checked at arrival.

Rate limits are per minute but enforced per second, as OpenAI says it may: each is a token bucket
holding one second's worth (limit / 60) that refills continuously. A request is admitted when the
bucket holds its cost. A request costing more than the whole bucket is admitted only when the
bucket is full, and drives the level negative, so the long-run rate still holds (this is also what
makes rpm < 60 work). A concurrency limit caps the requests in flight. All checks happen on
arrival, under one lock, before the simulated latency, and a 429 consumes nothing. The
x-ratelimit-remaining-* headers count what is left in the one-second bucket (never below 0);
x-ratelimit-reset-* is the time until it is full, as a Go-style duration like OpenAI's ("20ms",
"1.5s", "6m0s"). A concurrency 429 has no bucket to wait for, so it says to retry after one mean
latency.

error_rate and hang_rate are drawn per admitted request from the seeded RNG.
"""

from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass

from .settings import MockJudgeSettings

_COUNTERS = (
    "requests",
    "accepted",
    "rate_limited",
    "errors",
    "client_errors",
    "hangs",
    "connections_opened",
    "tokens",
    "items",
    "prompt_tokens",
    "completion_tokens",
)


def _ceil_ms(seconds: float) -> int:
    # round off float noise first, so 0.1 s is 100 ms and not 101
    return math.ceil(round(seconds * 1000, 6))


def _duration(seconds: float) -> str:
    """Format like OpenAI's x-ratelimit-reset-* headers: "20ms", "1s", "1.5s", "6m0s", "1h0m0s"."""
    ms = _ceil_ms(seconds)
    if 0 < ms < 1000:
        return f"{ms}ms"
    minutes, ms = divmod(ms, 60_000)
    hours, minutes = divmod(minutes, 60)
    text = f"{ms / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    return f"{hours}h{text}" if hours else text


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


class _Bucket:
    """Token bucket holding one second's worth of a per-minute limit."""

    def __init__(self, per_minute: float, now: float) -> None:
        self.per_minute = per_minute
        self.rate = per_minute / 60
        self.capacity = self.rate
        self.level = self.capacity
        self.stamp = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def admits(self, cost: float) -> bool:
        return self.level >= min(cost, self.capacity)

    def wait_for(self, cost: float) -> float:
        return max(0.0, min(cost, self.capacity) - self.level) / self.rate

    def headers(self, kind: str) -> dict[str, str]:
        return {
            f"x-ratelimit-limit-{kind}": _number(self.per_minute),
            f"x-ratelimit-remaining-{kind}": str(max(0, math.floor(self.level))),
            f"x-ratelimit-reset-{kind}": _duration((self.capacity - self.level) / self.rate),
        }


@dataclass
class _Ticket:
    """The outcome of admission: a refusal (kind, message, seconds to wait) or the random draws."""

    headers: dict[str, str]
    refusal: tuple[str, str, float] | None = None
    latency_s: float = 0.0
    error: bool = False
    hang: bool = False


class _Judge:
    """Limits, counters and the seeded RNG shared by all handler threads, behind one lock."""

    def __init__(self, settings: MockJudgeSettings) -> None:
        self.settings = settings
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._faulted_once: set[tuple[str, str]] = set()
        self._rng = random.Random(settings.seed)
        now = time.monotonic()
        self._requests = _Bucket(settings.rpm, now) if settings.rpm > 0 else None
        self._tokens = _Bucket(settings.tpm, now) if settings.tpm > 0 else None
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._in_flight = 0
        self._peak = 0
        self._gate = threading.Condition()
        self._answers_left: int | None = None  # None: answer all; n: n more, then hold

    def hold_after(self, answers: int | None) -> None:
        """Answer `answers` more admitted calls, then hold every reply until
        `hold_after(None)`: a test then knows its batch cannot finish before it says so."""
        with self._gate:
            self._answers_left = answers
            self._gate.notify_all()

    def wait_turn(self) -> None:
        """An admitted call's turn to be answered (at once unless held)."""
        with self._gate:
            while self._answers_left == 0 and not self.stopping.is_set():
                self._gate.wait()
            if self._answers_left:
                self._answers_left -= 1

    def count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount

    def first_time(self, fault: str, text: str) -> bool:
        """Whether no request has met `fault` judging `text` before ([[mock:hang-once]],
        [[mock:500-once]])."""
        with self._lock:
            seen = (fault, text) in self._faulted_once
            self._faulted_once.add((fault, text))
            return not seen

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self._counts, "in_flight": self._in_flight, "peak_in_flight": self._peak}

    def reset(self) -> None:
        with self._lock:
            self._counts = dict.fromkeys(_COUNTERS, 0)
            self._peak = self._in_flight

    def pause(self, seconds: float) -> None:
        """Sleep, but wake up when the server stops so hanging handlers do not outlive it."""
        if seconds > 0:
            self.stopping.wait(seconds)

    def admit(self, tokens: int) -> _Ticket:
        """Check every limit at arrival; on success take the cost and draw latency and faults."""
        with self._lock:
            now = time.monotonic()
            for bucket in (self._requests, self._tokens):
                if bucket:
                    bucket.refill(now)
            ticket = _Ticket(headers={}, refusal=self._refusal(tokens))
            if ticket.refusal is None:
                if self._requests:
                    self._requests.level -= 1
                if self._tokens:
                    self._tokens.level -= tokens
                self._in_flight += 1
                self._peak = max(self._peak, self._in_flight)
                self._counts["tokens"] += tokens
                ticket.latency_s = self._draw_latency()
                ticket.error = self._rng.random() < self.settings.error_rate
                ticket.hang = self._rng.random() < self.settings.hang_rate
            if self._requests:
                ticket.headers |= self._requests.headers("requests")
            if self._tokens:
                ticket.headers |= self._tokens.headers("tokens")
            return ticket

    def release(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def _refusal(self, tokens: int) -> tuple[str, str, float] | None:
        if self._requests and not self._requests.admits(1):
            limit = _number(self._requests.per_minute)
            message = f"Rate limit reached for requests per min (RPM): Limit {limit}"
            return "requests", message, self._requests.wait_for(1)
        if self._tokens and not self._tokens.admits(tokens):
            limit = f"Limit {_number(self._tokens.per_minute)}, Requested {tokens}"
            message = f"Rate limit reached for tokens per min (TPM): {limit}"
            return "tokens", message, self._tokens.wait_for(tokens)
        most = self.settings.max_concurrent
        if most > 0 and self._in_flight >= most:
            message = f"Rate limit reached for concurrency: Limit {most} requests in flight"
            return "concurrency", message, self.settings.latency_ms / 1000
        return None

    def _draw_latency(self) -> float:
        mean, cv = self.settings.latency_ms / 1000, self.settings.latency_cv
        if 0 < self.settings.degrade_above < self._in_flight:  # an overloaded server
            mean *= 2
        if mean <= 0 or cv <= 0:
            return max(mean, 0.0)
        sigma2 = math.log1p(cv * cv)
        return self._rng.lognormvariate(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))
