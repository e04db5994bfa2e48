"""One backend call through its layers, outermost first, one concern each:

breaker    refuses while the backend's circuit is open (a sibling backend may take the work)
limiter    the call's grant (booked here unless the runner booked it) and its wait; after the
           call it learns from the reply (`_learn`), which may make a 429 flow control
clearance  no call for a batch nobody waits for (Cancelled) or past the budget (BudgetExceeded)
transport  the backend client's call (HTTP or a function; the client parses the reply into
           scores), timed, its tokens added to the spend
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..backends import Call, make_backend
from ..config import Backend
from ..errors import (
    BudgetExceeded,
    Cancelled,
    LimiterBusy,
    RateLimited,
    ScoringError,
    TransientError,
)
from ..flow.breaker import CircuitBreaker
from ..flow.limiter import Grant, Limiter, Reading
from ..flow.spend import Booking, Ledger, Usage
from ..ops import metrics

MAX_LIMITER_WAIT_S = 30.0


class CallPath:
    """Makes one call of a chunk through the layers; raises the call's ScoringError.

    `may_refuse`: an open circuit refuses calls only while siblings remain. `stop()` names
    why no call may start (asked before each). `observe(latency_s)` gets each reply's latency
    (the call pool sizes itself by it). `over_budget` says a call was refused by the budget.
    """

    def __init__(
        self,
        config: Backend,
        limiter: Limiter | None,
        breaker: CircuitBreaker | None,
        may_refuse: bool,
        stop: Callable[[], str | None],
        ledger: Ledger | None,
        batch_id: str | None,
    ):
        self.config, self.limiter, self.breaker = config, limiter, breaker
        self.may_refuse, self.stop = may_refuse, stop
        self.ledger, self.batch_id = ledger, batch_id
        self.client = make_backend(config)  # one per backend per process: shared connections
        self.observe: Callable[[float], None] | None = None
        self.over_budget = False

    def call(self, batch: list[dict], grant: Grant | None) -> Call:
        self._breaker_admits(grant)
        grant = self._granted(batch, grant)
        booking = self._cleared(batch, grant)
        return self._transport(batch, grant, booking)

    # -- breaker ---------------------------------------------------------------------------

    def _breaker_admits(self, grant: Grant | None) -> None:
        if self.may_refuse and self.breaker is not None and not self.breaker.allow():
            if grant is not None:
                grant.finish()
            raise TransientError(f"circuit open: backend {self.config.name!r} is cooling down")

    # -- limiter ---------------------------------------------------------------------------

    def _granted(self, batch: list[dict], grant: Grant | None) -> Grant | None:
        if grant is not None or self.limiter is None:
            return grant
        try:
            (grant,) = self.limiter.reserve(
                1, self.client.estimate_tokens(batch), MAX_LIMITER_WAIT_S
            )
        except LimiterBusy:  # the call never happens: a half-open probe goes to someone else
            if self.breaker is not None:
                self.breaker.release_probe()
            raise
        return grant

    def _learn(self, grant: Grant | None, result: Call | ScoringError, failed: bool) -> Reading:
        """Tell the limiter what the backend's kind reads from the reply (read only when a
        limiter is there to learn it), and the breaker how the call went; what the limiter
        made of it."""
        reading = Reading()
        if grant is not None:
            reading = grant.learn(self.client.feedback(result))
        elif self.limiter is not None:
            reading = self.limiter.learn(self.client.feedback(result))
        if self.breaker is not None:  # a 429 counts as alive: flow control handles it
            self.breaker.failure() if failed else self.breaker.success()
        return reading

    # -- clearance -------------------------------------------------------------------------

    def _cleared(self, batch: list[dict], grant: Grant | None) -> Booking | None:
        """Wait out the grant, then check the call may be made now (its budget booking)."""
        try:
            if grant is not None:
                grant.wait()
                metrics.record_limiter_wait(self.config.name, grant.wait_s)
            return self._clearance(batch)
        except BaseException as exc:  # the call is not made: its lease (and probe) go back
            if grant is not None:
                grant.finish()
            if self.breaker is not None and isinstance(exc, ScoringError):
                self.breaker.release_probe()
            raise

    def _clearance(self, batch: list[dict]) -> Booking | None:
        """Cancelled when nobody waits for the call any more, BudgetExceeded when it would
        pass the backend's budget (else its booking)."""
        stopped = self.stop()
        if stopped:
            raise Cancelled(stopped)
        if self.ledger is None or not self.ledger.has_budget:  # no estimate to book
            return None
        try:
            return self.ledger.book(Usage.estimate(*self.client.estimate_usage(batch)))
        except BudgetExceeded:
            self.over_budget = True
            raise

    # -- transport -------------------------------------------------------------------------

    def _transport(self, batch: list[dict], grant: Grant | None, booking: Booking | None) -> Call:
        started = time.monotonic()
        try:
            call = self.client.call(batch)
        except BaseException as exc:
            self._failed(batch, grant, booking, exc, started)
            raise
        return self._answered(batch, grant, booking, call, started)

    async def call_async(self, batch: list[dict]) -> Call:
        """`call` on the worker's call loop, for a kind whose calls only wait on a server
        (`awaitable`) and a backend with no limiter: no layer but the transport waits."""
        self._breaker_admits(None)
        booking = self._cleared(batch, None)
        started = time.monotonic()
        try:
            call = await self.client.call_async(batch)
        except BaseException as exc:
            self._failed(batch, None, booking, exc, started)
            raise
        return self._answered(batch, None, booking, call, started)

    def _answered(self, batch: list[dict], grant: Grant | None, booking: Booking | None,
                  call: Call, started: float) -> Call:
        self._spent(batch, call, booking, replied=True)
        latency_s = time.monotonic() - started
        metrics.record_request(self.config.name, call.status_code, latency_s)
        if self.observe is not None:
            self.observe(latency_s)
        self._learn(grant, call, failed=False)
        return call

    def _failed(self, batch: list[dict], grant: Grant | None, booking: Booking | None,
                exc: BaseException, started: float) -> None:
        """Account for a call that raised `exc` (re-raised by the caller): a ScoringError's
        reply is learned from, and its RateLimited told whether the limiter paced it."""
        if not isinstance(exc, ScoringError):
            self._spent(batch, None, booking, replied=False)
            if grant is not None:
                grant.finish()
            return
        self._spent(batch, None, booking, replied=200 <= (exc.status_code or 0) < 300)
        metrics.record_request(self.config.name, exc.status_code, time.monotonic() - started,
                               "timeout" if exc.timed_out else "error")
        reading = self._learn(grant, exc, failed=isinstance(exc, TransientError))
        if isinstance(exc, RateLimited):
            exc.flow_control = reading.flow_control
        if reading.pause_s:  # the limiter holds everyone back: no wait of the caller's own
            exc.retry_after_s = 0.0

    def _spent(self, batch: list[dict], call: Call | None, booking: Booking | None,
               replied: bool) -> None:
        """Add the call's tokens to the spend: the reply's usage, else the estimate when the
        backend answered (it may bill), else nothing (no reply: no usage known)."""
        if self.ledger is None:
            return
        if call is not None and call.usage is not None:
            usage = Usage(*call.usage)
        elif replied and not self.client.runs_locally:  # a local call spends no tokens
            usage = Usage.estimate(*self.client.estimate_usage(batch))
        else:
            usage = Usage(0, 0)
        self.ledger.spent(usage, booking, self.batch_id)
