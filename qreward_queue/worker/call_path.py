"""One backend call through its layers, outermost first, one concern each:

breaker    refuses while the backend's circuit is open (a sibling backend may take the work)
limiter    the call's grant (booked here unless the runner booked it) and its wait; after the
           call it is released with what the reply taught (which may make a 429 flow control)
clearance  no call for a batch nobody waits for (Cancelled) or past the budget (BudgetExceeded)
transport  the backend client's call (HTTP or a function; the client parses the reply into
           scores), timed, its tokens added to the spend
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..backends import BackendClient, Call, make_backend
from ..config.model import Backend
from ..errors import (
    BudgetExceeded,
    Cancelled,
    CircuitOpen,
    LimiterBusy,
    RateLimited,
    ScoringError,
    TransientError,
)
from ..flow.breaker import CircuitBreaker
from ..flow.limiter import Grant, Limiter, Reading
from ..flow.ratelimit_headers import NO_FEEDBACK, Feedback
from ..flow.spend import Booking, Ledger, Usage
from ..message import DEFAULT_JOB
from ..ops import metrics

MAX_LIMITER_WAIT_S = 30.0
HEDGE_LIMITER_WAIT_S = 1.0  # a hedge waits for its grant until its first call's timeout, this
# long at least: a busy limiter's queue still lets it beat a hung call's timeout
HEDGE_OVERRUN_S = 3.0  # a hedge still running this long past its first call's timeout is
# dropped: every call ends by then (a handed-off straggler's task comes back only after it)


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
        job: str = DEFAULT_JOB,
    ):
        self.config, self.limiter, self.breaker = config, limiter, breaker
        self.may_refuse, self.stop = may_refuse, stop
        self.ledger, self.batch_id, self.job = ledger, batch_id, job
        self.client = make_backend(config)  # one per backend per process: shared connections
        self.observe: Callable[[float], None] | None = None
        # on the call loop: how long a reply may take before a hedge (None: never)
        self.hedge_after_s: Callable[[], float | None] | None = None
        self.over_budget = False

    def call(self, batch: list[dict], grant: Grant | None = None) -> Call:
        """The call on this thread (its grant booked here unless the runner booked it)."""
        self._breaker_admits(grant)
        grant = self._granted(batch, grant)
        with self._given_back_unless_made(grant):
            if grant is not None:
                grant.wait()
            booking = self._clearance(batch, grant)
        started = time.monotonic()
        try:
            result: Call | ScoringError = self.client.call(batch)
        except ScoringError as exc:
            result = exc
        except BaseException:
            self._no_reply(batch, grant, booking)
            raise
        feedback = self._replied(batch, booking, result, started)
        reading = grant.release(feedback) if grant is not None else Reading()
        return self._concluded(result, reading)

    async def call_async(self, batch: list[dict], grant: Grant | None) -> Call:
        """`call` on the worker's call loop, for a kind whose calls only wait on a server
        (`awaitable`); `grant`: booked by the runner (else here) when the backend has a
        limiter."""
        self._breaker_admits(grant)
        grant = await self._granted_async(batch, grant)
        with self._given_back_unless_made(grant):
            if grant is not None:
                await grant.wait_async()
            booking = self._clearance(batch, grant)
        started = time.monotonic()
        try:
            result, hedged = await self._answered(batch, booking)
        except BaseException:
            self._no_reply(batch, grant, booking)
            raise
        feedback = self._replied(batch, booking, result, started)
        if hedged:  # the hedge's own grant learnt its reply; this one only goes back
            feedback = NO_FEEDBACK
        reading = await grant.release_async(feedback) if grant is not None else Reading()
        return self._concluded(result, reading)

    # -- hedge -----------------------------------------------------------------------------

    async def _answered(self, batch: list[dict], booking: Booking | None
                        ) -> tuple[Call | ScoringError, bool]:
        """The transport's answer, and whether a hedge gave it. A call whose reply is far later
        than the backend's usual (`hedge_after_s`) gets a second call of the same samples and
        the first good answer wins, the other is abandoned: a connection that hangs costs
        one more call, not the whole `timeout_s` that every sample of the batch waits for.
        Until then a call pays one timer for it, no task."""
        after = self.hedge_after_s() if self.hedge_after_s and self._may_hedge(booking) \
            else None
        if after is None:
            return await _answer(self.client, batch), False
        loop = asyncio.get_running_loop()
        ends_by = loop.time() + self.config.timeout_s + HEDGE_OVERRUN_S
        hedge = _Hedge(self, batch, max(HEDGE_LIMITER_WAIT_S, self.config.timeout_s - after))
        timer = loop.call_later(after, hedge.start)
        try:
            result = await _answer(self.client, batch)
            hedge.first_ended = True
            if isinstance(result, ScoringError) and hedge.task is not None:
                # the first failed while its hedge goes on: its answer, if it comes in time
                done, _ = await asyncio.wait({hedge.task}, timeout=ends_by - loop.time())
                if done and isinstance(second := hedge.task.result(), Call):
                    return second, True
            return result, False
        except asyncio.CancelledError:
            uncancel = getattr(asyncio.current_task(), "uncancel", None)  # 3.11: counted
            if hedge.won is None or (uncancel is not None and uncancel() > 0):
                raise  # cancelled from outside, not (only) by the hedge's answer
            return hedge.won, True
        finally:
            timer.cancel()
            hedge.abandon()

    def _may_hedge(self, booking: Booking | None) -> bool:
        """A budget books one call per sample (a call under one always has its `booking`), a
        local call has no connection to hang."""
        return self.config.retry.hedge and booking is None and not self.client.runs_locally

    async def _hedge(self, batch: list[dict], wait_s: float) -> Call | ScoringError | None:
        """The second call: its own grant (None when the limiter cannot start it within
        `wait_s`, or nobody waits for the batch any more), its reply learnt by the limiter."""
        grant = None
        if self.limiter is not None:
            try:
                (grant,) = await self.limiter.reserve_async(
                    1, self.client.estimate_tokens(batch), wait_s)
            except LimiterBusy:
                return None
        try:
            if grant is not None:
                await grant.wait_async()
            if self.stop():
                result = None
            else:
                metrics.record_retry(self.config.name, "hedge")
                result = await _answer(self.client, batch)
        except BaseException:  # the first call answered: this one is abandoned
            if grant is not None:
                await grant.release_async(NO_FEEDBACK)
            raise
        if grant is not None:
            await grant.release_async(
                NO_FEEDBACK if result is None else self.client.feedback(result))
        return result

    # -- breaker ---------------------------------------------------------------------------

    def _breaker_admits(self, grant: Grant | None) -> None:
        if self.may_refuse and self.breaker is not None and not self.breaker.allow():
            if grant is not None:
                grant.release(NO_FEEDBACK)
            raise CircuitOpen(f"circuit open: backend {self.config.name!r} is cooling down")

    # -- limiter ---------------------------------------------------------------------------

    def _granted(self, batch: list[dict], grant: Grant | None) -> Grant | None:
        if grant is not None or self.limiter is None:
            return grant
        with self._probe_back_if_busy():
            (grant,) = self.limiter.reserve(
                1, self.client.estimate_tokens(batch), MAX_LIMITER_WAIT_S
            )
        return grant

    async def _granted_async(self, batch: list[dict], grant: Grant | None) -> Grant | None:
        if grant is not None or self.limiter is None:
            return grant
        with self._probe_back_if_busy():
            (grant,) = await self.limiter.reserve_async(
                1, self.client.estimate_tokens(batch), MAX_LIMITER_WAIT_S
            )
        return grant

    @contextmanager
    def _probe_back_if_busy(self) -> Iterator[None]:
        """A call the limiter cannot start soon never happens: its half-open probe goes to
        someone else."""
        try:
            yield
        except LimiterBusy:
            if self.breaker is not None:
                self.breaker.release_probe()
            raise

    # -- clearance -------------------------------------------------------------------------

    @contextmanager
    def _given_back_unless_made(self, grant: Grant | None) -> Iterator[None]:
        """What the block raises means the call is not made: its lease (and probe) go back."""
        try:
            yield
        except BaseException as exc:
            if grant is not None:
                grant.release(NO_FEEDBACK)
            if self.breaker is not None and isinstance(exc, ScoringError):
                self.breaker.release_probe()
            raise

    def _clearance(self, batch: list[dict], grant: Grant | None) -> Booking | None:
        """After the grant's wait: Cancelled when nobody waits for the call any more,
        BudgetExceeded when it would pass the backend's budget (else its booking)."""
        if grant is not None:
            metrics.record_limiter_wait(self.config.name, grant.wait_s)
        stopped = self.stop()
        if stopped:
            raise Cancelled(stopped)
        if self.ledger is None or not self.ledger.has_budget:  # no estimate to book
            return None
        try:
            return self.ledger.book(self._bound(batch))
        except BudgetExceeded:
            self.over_budget = True
            raise

    # -- after the transport ---------------------------------------------------------------

    def _no_reply(self, batch: list[dict], grant: Grant | None, booking: Booking | None) -> None:
        """A call that raised what no reply explains (a bug, an interrupt): nothing spent,
        its lease back."""
        self._spent(batch, None, booking, replied=False)
        if grant is not None:
            grant.release(NO_FEEDBACK)

    def _replied(self, batch: list[dict], booking: Booking | None, result: Call | ScoringError,
                 started: float) -> Feedback:
        """Count the call (spend, metrics, latency, the breaker); what its limiter learns."""
        latency_s = time.monotonic() - started
        if isinstance(result, ScoringError):
            self._spent(batch, None, booking, replied=200 <= (result.status_code or 0) < 300)
            metrics.record_request(self.config.name, result.status_code, latency_s,
                                   "timeout" if result.timed_out else "error")
        else:
            self._spent(batch, result, booking, replied=True)
            metrics.record_request(self.config.name, result.status_code, latency_s)
            if self.observe is not None:
                self.observe(latency_s)
        if self.breaker is not None:  # a 429 counts as alive: flow control handles it
            failed = isinstance(result, TransientError)
            self.breaker.failure() if failed else self.breaker.success()
        # read only when a limiter is there to learn it
        return self.client.feedback(result) if self.limiter is not None else NO_FEEDBACK

    @staticmethod
    def _concluded(result: Call | ScoringError, reading: Reading) -> Call:
        """The call, or its error raised: a RateLimited told whether the limiter paced it."""
        if isinstance(result, Call):
            return result
        if isinstance(result, RateLimited):
            result.flow_control = reading.flow_control
        if reading.pause_s:  # the limiter holds everyone back: no wait of the caller's own
            result.retry_after_s = 0.0
        raise result

    def _spent(self, batch: list[dict], call: Call | None, booking: Booking | None,
               replied: bool) -> None:
        """Add the call's tokens to the spend: the reply's usage, else the estimate when the
        backend answered (it may bill), else nothing (no reply: no usage known)."""
        if self.ledger is None:
            return
        if call is not None and call.usage is not None:
            usage = Usage(*call.usage)
            if self.ledger.has_budget:  # what tokens a byte costs only bounds bookings
                self.ledger.observe(self.client.input_bytes(batch), usage.tokens_in)
        elif replied and not self.client.runs_locally:  # a local call spends no tokens
            usage = self._bound(batch, learned=False)
        else:
            usage = Usage(0, 0)
        self.ledger.spent(usage, booking, self.batch_id, self.job)

    def _bound(self, batch: list[dict], learned: bool = True) -> Usage:
        """The most the call can cost (`Ledger.bound`): booked, and counted when no usage came."""
        assert self.ledger is not None
        return self.ledger.bound(self.client.input_bytes(batch),
                                 self.client.estimate_usage(batch)[1], learned)


async def _answer(client: BackendClient, batch: list[dict]) -> Call | ScoringError:
    """The client's call on the loop, its ScoringError returned."""
    try:
        return await client.call_async(batch)
    except ScoringError as exc:
        return exc


class _Hedge:
    """The second call of a late call's batch: started by the first's timer, it interrupts the
    first (cancels the task awaiting it) with its answer when that answer is good."""

    def __init__(self, path: CallPath, batch: list[dict], wait_s: float):
        self.path, self.batch, self.wait_s = path, batch, wait_s
        self.owner = asyncio.current_task()
        self.task: asyncio.Task[Call | ScoringError | None] | None = None
        self.won: Call | None = None
        self.first_ended = False

    def start(self) -> None:
        self.task = asyncio.ensure_future(self.path._hedge(self.batch, self.wait_s))
        self.task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[Call | ScoringError | None]) -> None:
        if task.cancelled() or task.exception() is not None or self.first_ended:
            return
        if isinstance(result := task.result(), Call) and self.owner is not None:
            self.won = result
            self.owner.cancel()

    def abandon(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
