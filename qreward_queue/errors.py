"""The error hierarchy; each scoring error maps onto one outcome status.

QrqError
├── ConfigError        a broken qrq.toml or workers/*.toml (names file and key)
├── InvalidSamples     samples rejected before anything is queued (names every index)
├── UnknownRoute       submit_batch(route=...) names no configured route or backend
├── RedisUnreachable   distributed mode cannot use its Redis (names the URL, no password)
└── ScoringError       a sample could not be scored: outcome status `status` ("error")
    ├── RetryableError     worth another try, here or on a sibling backend
    │   ├── RateLimited        HTTP 429 (carries Retry-After)
    │   ├── TransientError     timeout, connection error, 5xx
    │   │   └── CircuitOpen        the backend's circuit is open: no call made
    │   ├── LimiterBusy        the global limiter cannot start the call soon: try again later
    │   └── BudgetExceeded     the call would pass the backend's budget: not made (a sibling
    │                          backend may take the sample; if none, status "error")
    ├── PermanentError     other 4xx, unparseable verdict: retrying cannot help
    │   └── SampleTimeout      a reward function ran over its time limit: status "timeout"
    ├── DeadlineExceeded   the batch deadline passed first: outcome status "timeout"
    └── Cancelled          nobody waits any more (cancel(), an interrupted wait, a lapsed
                           lease): outcome status "cancelled"
"""

from __future__ import annotations

from collections.abc import Mapping

from .redact import redact


class QrqError(Exception):
    """Base of every error qrq raises on purpose."""


class ConfigError(QrqError):
    """A configuration file is missing, unreadable or has a wrong value."""


class UnknownRoute(QrqError):
    """A route or backend name that the configuration does not define."""


class RedisUnreachable(QrqError):
    """Distributed mode cannot use its Redis: one line naming the URL (no password) and what
    to check. `submit_batch` raises it whatever part of the client met the outage."""


class InvalidSamples(QrqError):
    """Samples that failed validation; `problems` maps input index to the reason."""

    def __init__(self, problems: dict[int, str]):
        self.problems = dict(sorted(problems.items()))
        lines = [f"sample {i}: {why}" for i, why in self.problems.items()]
        super().__init__(f"{len(lines)} invalid sample(s):\n  " + "\n  ".join(lines))


class ScoringError(QrqError):
    """A sample could not be scored; `detail` keeps what the backend said, `status` is the
    outcome status it becomes.

    The HTTP facts (status, headers, whether the call timed out) travel with the error so the
    limiter can learn from failures as well as from successes. Message and detail quote the
    backend, so both are redacted (no API key or bearer token survives in them).
    """

    status = "error"  # the outcome status a sample failing this way gets

    def __init__(
        self,
        message: str,
        detail: str | None = None,
        *,
        status_code: int | None = None,
        headers: Mapping[str, str] | None = None,
        timed_out: bool = False,
        retry_after_s: float | None = None,
    ):
        super().__init__(redact(message))
        self.detail = redact(detail)
        self.status_code = status_code
        self.headers = headers
        self.timed_out = timed_out
        self.retry_after_s = retry_after_s


class RetryableError(ScoringError):
    """Another attempt may succeed."""


class RateLimited(RetryableError):
    """The backend answered 429; `retry_after_s` is how long it asked us to wait, and
    `flow_control` whether the limiter acted on it (see `limiter.Reading`)."""

    flow_control = False


class TransientError(RetryableError):
    """Timeout, connection failure or 5xx."""


class CircuitOpen(TransientError):
    """The backend's circuit is open: no call was made (a sibling backend may take it)."""


class PermanentError(ScoringError):
    """A 4xx other than 429, or a reply we cannot parse: never retried blindly."""


class LimiterBusy(RetryableError):
    """The call cannot start within the wait allowed: retry the task after `wait_s` instead."""

    def __init__(self, wait_s: float, reason: str) -> None:
        super().__init__(f"limiter busy ({reason}): next start in {wait_s:.3f} s")
        self.wait_s = wait_s
        self.reason = reason


class BudgetExceeded(RetryableError):
    """A call that would pass a cap of the backend's `[budget]` was not made."""

    def __init__(self, backend: str, cap: str, limit: float, used: float, want: float) -> None:
        super().__init__(
            f"budget {cap} = {limit:g} of backend {backend!r} reached ({used:g} used, the call "
            f"needs ~{want:g}): the call was not made"
        )
        self.cap = cap


class JobBudgetExceeded(QrqError):
    """A job at a cap of its `[jobs.<job>.budget]`: submit_batch queues nothing for it."""


class DeadlineExceeded(ScoringError):
    """The batch deadline passed before the sample was scored."""

    status = "timeout"


class SampleTimeout(PermanentError):
    """A reward function ran over its per-sample time limit and was stopped."""

    status = "timeout"


class Cancelled(ScoringError):
    """The batch was cancelled, or its caller's lease lapsed, before the sample was scored."""

    status = "cancelled"
