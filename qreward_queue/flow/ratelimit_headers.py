"""Parse the rate-limit headers of OpenAI-compatible APIs (and Anthropic's) into numbers the
limiter can use.

Anthropic's `anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}` (the reset an
RFC 3339 time) fill the same fields as OpenAI's `x-ratelimit-*`, and its 529 "overloaded"
counts as a 429 (`RATE_LIMITED_STATUSES`): every provider feeds the same flow control.

Pure functions, no I/O: a backend's answer is untrusted input, so `RateLimitHeaders.from_headers`
turns every absent, negative or malformed value into ``None`` instead of raising in the middle
of a reward call, and bounds the rest (a capped pause, a floor under learned limits, a sane
reset), saying which bound was hit.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from email.utils import parsedate_to_datetime

_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|us|µs|ns|h|m|s)")
_DURATION = re.compile(rf"(?:{_PART.pattern})+")


def _number(value: str) -> float:
    """A finite, non-negative float, else ValueError (so 'nan', '-1' and 'inf' are garbage)."""
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"not a non-negative number: {value!r}")
    return number


def parse_duration(value: str) -> float:
    """Seconds in an OpenAI reset duration: ``20ms``, ``1.5s``, ``6m0s``, ``1h2m3.5s``.

    A bare number is taken as seconds, as some OpenAI-compatible servers send it.

    >>> parse_duration("1h2m3.5s"), parse_duration("20ms"), parse_duration("7")
    (3723.5, 0.02, 7.0)
    """
    text = value.strip()
    if _DURATION.fullmatch(text):
        return sum(float(amount) * _UNIT_S[unit] for amount, unit in _PART.findall(text))
    return _number(text)


def parse_reset(value: str, now: float | None = None) -> float:
    """Seconds until a reset: a duration (OpenAI's ``6m0s``) or an RFC 3339 time (Anthropic's
    ``2026-01-01T00:00:30Z``; one in the past gives 0).

    >>> parse_reset("1.5s"), parse_reset("1970-01-01T00:00:10Z", now=4.0)
    (1.5, 6.0)
    """
    try:
        return parse_duration(value)
    except ValueError:
        when = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    if when.tzinfo is None:
        raise ValueError(f"not a reset time with a zone: {value!r}")
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def parse_retry_after(value: str, now: float | None = None) -> float:
    """Seconds to wait from a ``Retry-After`` value: delay-seconds or an HTTP-date.

    A date in the past gives 0. ``now`` (epoch seconds) defaults to the local clock, which only
    matters for the date form.

    >>> parse_retry_after("2"), parse_retry_after("Thu, 01 Jan 1970 00:00:10 GMT", now=4.0)
    (2.0, 6.0)
    """
    text = value.strip()
    try:
        return _number(text)
    except ValueError:
        try:
            when = parsedate_to_datetime(text).timestamp()
        except (TypeError, ValueError, IndexError, OverflowError) as exc:
            raise ValueError(f"not a Retry-After value: {value!r}") from exc
    return max(0.0, when - (time.time() if now is None else now))


DEFAULT_MAX_PAUSE_S = 60.0  # [limits] max_pause_s: the longest pause one reply can order
MAX_RESET_S = 86_400.0  # a reset further away than a day is garbage (Redis refuses 1e308 ms)
MIN_LEARNED_LIMIT = 1.0  # a learned limit below 1 per minute would stop the backend for good
MAX_COUNT = 1e12  # no limit or remaining count is larger than this
RATE_LIMITED_STATUSES = frozenset({429, 529})  # refused for rate; 529: Anthropic's overloaded


@dataclass(frozen=True)
class RateLimitHeaders:
    """What a backend said about its limits, validated and bounded.

    Every field is ``None`` when absent, unreadable or implausible; `bounded` says, in one line
    each, which values were capped or ignored (for `qrq status` and the outcome detail). A
    Retry-After is capped at `max_pause_s`, resets at MAX_RESET_S, and a limit below
    MIN_LEARNED_LIMIT is ignored, so no single reply can stop a backend for long.

    >>> h = RateLimitHeaders.from_headers({"X-RateLimit-Remaining-Requests": "12",
    ...                                    "x-ratelimit-reset-tokens": "6m0s", "Retry-After": "x"})
    >>> h.remaining_requests, h.reset_tokens_s, h.retry_after_s
    (12.0, 360.0, None)
    >>> h.bounded
    ("retry-after 'x' ignored: not a delay",)
    >>> RateLimitHeaders.from_headers({"retry-after": "999999"}, max_pause_s=60).pause_s()
    60.0
    """

    limit_requests: float | None = None
    limit_tokens: float | None = None
    remaining_requests: float | None = None
    remaining_tokens: float | None = None
    reset_requests_s: float | None = None
    reset_tokens_s: float | None = None
    retry_after_s: float | None = None
    bounded: tuple[str, ...] = field(default=(), compare=False)
    max_pause_s: float = field(default=DEFAULT_MAX_PAUSE_S, compare=False)

    @classmethod
    def from_headers(
        cls,
        headers: Mapping[str, str] | None,
        now: float | None = None,
        max_pause_s: float = DEFAULT_MAX_PAUSE_S,
    ) -> RateLimitHeaders:
        """Read the ``x-ratelimit-*`` and ``Retry-After``/``retry-after-ms`` headers.

        Header names are matched case-insensitively whatever the mapping type is.
        """
        lowered = {name: str(v) for k, v in (headers or {}).items()
                   if "ratelimit" in (name := str(k).lower()) or name.startswith("retry-after")}
        if not lowered:  # a self-hosted judge's every reply: nothing to read
            return cls(max_pause_s=max_pause_s)
        notes: list[str] = []

        def read(name: str, parse, low: float, high: float, unit: str = "") -> float | None:
            raw = lowered.get(name)
            if raw is None and name.startswith("x-ratelimit-"):  # Anthropic's name for it
                kind, part = name.removeprefix("x-ratelimit-").split("-")[::-1]
                name = f"anthropic-ratelimit-{kind}-{part}"
                raw = lowered.get(name)
            if raw is None:
                return None
            try:
                value = parse(raw)
            except (TypeError, ValueError, OverflowError):
                notes.append(f"{name} {raw[:40]!r} ignored: not a {'delay' if unit else 'count'}")
                return None
            if value < low:
                notes.append(f"{name} {raw[:40]} ignored: below {low:g}{unit}")
                return None
            if value > high:
                if unit:  # a delay: wait at most `high`
                    notes.append(f"{name} {raw[:40]} capped at {high:g}{unit}")
                    return float(high)
                notes.append(f"{name} {raw[:40]} ignored: above {high:g}")
                return None
            return value

        def count(name: str, low: float = 0.0) -> float | None:
            return read(name, _number, low, MAX_COUNT)

        def delay(name: str, parse, high: float) -> float | None:
            return read(name, parse, 0.0, high, " s")

        def reset(value: str) -> float:
            return parse_reset(value, now)

        if "retry-after-ms" in lowered:
            retry_ms = read("retry-after-ms", _number, 0.0, max_pause_s * 1000, " ms")
            retry_after = None if retry_ms is None else retry_ms / 1000.0
        else:
            retry_after = delay("retry-after", lambda v: parse_retry_after(v, now), max_pause_s)
        return cls(
            limit_requests=count("x-ratelimit-limit-requests", MIN_LEARNED_LIMIT),
            limit_tokens=count("x-ratelimit-limit-tokens", MIN_LEARNED_LIMIT),
            remaining_requests=count("x-ratelimit-remaining-requests"),
            remaining_tokens=count("x-ratelimit-remaining-tokens"),
            reset_requests_s=delay("x-ratelimit-reset-requests", reset, MAX_RESET_S),
            reset_tokens_s=delay("x-ratelimit-reset-tokens", reset, MAX_RESET_S),
            retry_after_s=retry_after,
            bounded=tuple(notes),
            max_pause_s=max_pause_s,
        )

    def rate_left(self) -> bool:
        """True when the headers say requests (and tokens, if told) remain: a 429 then means
        too many calls in flight, not an exhausted rate."""
        return bool(self.remaining_requests) and self.remaining_tokens != 0

    def pause_s(self, default_s: float = 0.0) -> float:
        """How long a 429 should pause the backend: Retry-After, else the reset of an
        exhausted limit, else `default_s` (0: no pause; each call backs off on its own with
        jitter); never more than `max_pause_s`."""
        if self.retry_after_s is not None:
            return min(self.retry_after_s, self.max_pause_s)
        exhausted = [
            reset
            for reset, left in (
                (self.reset_requests_s, self.remaining_requests),
                (self.reset_tokens_s, self.remaining_tokens),
            )
            if reset is not None and not left
        ]
        return min(max(exhausted, default=default_s), self.max_pause_s)


@dataclass(frozen=True)
class Feedback:
    """What one call taught flow control, as its backend's kind reads the reply (see
    `BackendClient.feedback`): the limiter learns only from this, whatever the transport.

    The default says nothing: the lease is released and no limit learned (a function).

    >>> f = Feedback.from_http(429, {"retry-after": "2", "x-ratelimit-remaining-requests": "0"})
    >>> f.rate_limited, f.answered, f.told.pause_s()
    (True, False, 2.0)
    """

    answered: bool = False  # the service took the call and answered it (HTTP 2xx)
    rate_limited: bool = False  # the service refused it for its rate (HTTP 429, 529)
    timed_out: bool = False  # no reply within the call's timeout
    told: RateLimitHeaders = field(default_factory=RateLimitHeaders)  # its limits, as it said
    tokens: int | None = None  # tokens the call used, as the reply reported them

    @classmethod
    def from_http(
        cls,
        status_code: int | None,
        headers: Mapping[str, str] | None,
        timed_out: bool = False,
        max_pause_s: float = DEFAULT_MAX_PAUSE_S,
        tokens: int | None = None,
    ) -> Feedback:
        """An HTTP reply's status and `x-ratelimit-*` / `Retry-After` headers."""
        return cls(
            answered=status_code is not None and 200 <= status_code < 300,
            rate_limited=status_code in RATE_LIMITED_STATUSES,
            timed_out=timed_out,
            told=RateLimitHeaders.from_headers(headers, max_pause_s=max_pause_s),
            tokens=tokens,
        )


NOTHING_TOLD = RateLimitHeaders()  # equal to any reply's that said nothing of its limits
NO_FEEDBACK = Feedback()  # a call not made (or whose reply another call's grant learnt)
