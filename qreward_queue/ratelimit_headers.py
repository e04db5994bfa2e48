"""Parse the rate-limit headers of OpenAI-compatible APIs into numbers the limiter can use.

Pure functions, no I/O: a backend's answer is untrusted input, so `RateLimitHeaders.from_headers`
turns every absent, negative or malformed value into ``None`` instead of raising in the middle
of a reward call.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
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


@dataclass(frozen=True)
class RateLimitHeaders:
    """What a backend said about its limits; every field is ``None`` when absent or unreadable.

    >>> h = RateLimitHeaders.from_headers({"X-RateLimit-Remaining-Requests": "12",
    ...                                    "x-ratelimit-reset-tokens": "6m0s", "Retry-After": "x"})
    >>> h.remaining_requests, h.reset_tokens_s, h.retry_after_s
    (12.0, 360.0, None)
    """

    limit_requests: float | None = None
    limit_tokens: float | None = None
    remaining_requests: float | None = None
    remaining_tokens: float | None = None
    reset_requests_s: float | None = None
    reset_tokens_s: float | None = None
    retry_after_s: float | None = None

    @classmethod
    def from_headers(
        cls, headers: Mapping[str, str] | None, now: float | None = None
    ) -> RateLimitHeaders:
        """Read the ``x-ratelimit-*`` and ``Retry-After``/``retry-after-ms`` headers.

        Header names are matched case-insensitively whatever the mapping type is.
        """
        lowered = {str(k).lower(): str(v) for k, v in (headers or {}).items()}

        def read(name: str, parse) -> float | None:
            raw = lowered.get(name)
            if raw is None:
                return None
            try:
                return parse(raw)
            except (TypeError, ValueError, OverflowError):
                return None

        retry_ms = read("retry-after-ms", _number)
        return cls(
            limit_requests=read("x-ratelimit-limit-requests", _number),
            limit_tokens=read("x-ratelimit-limit-tokens", _number),
            remaining_requests=read("x-ratelimit-remaining-requests", _number),
            remaining_tokens=read("x-ratelimit-remaining-tokens", _number),
            reset_requests_s=read("x-ratelimit-reset-requests", parse_duration),
            reset_tokens_s=read("x-ratelimit-reset-tokens", parse_duration),
            retry_after_s=(
                retry_ms / 1000.0
                if retry_ms is not None
                else read("retry-after", lambda v: parse_retry_after(v, now))
            ),
        )
