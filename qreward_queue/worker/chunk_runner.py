"""One run of a chunk: each of its calls made once, concurrently, on the process's call pool
(grants booked in bulk), through the call path; what became of each sample."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from functools import partial

from ..backends import Call
from ..config import Backend
from ..errors import (
    BudgetExceeded,
    Cancelled,
    LimiterBusy,
    PermanentError,
    RateLimited,
    RetryableError,
    ScoringError,
)
from ..flow.breaker import CircuitBreaker
from ..flow.limiter import Grant, Limiter
from ..flow.spend import Ledger
from ..samples import Outcome
from .call_loop import call_loop, runs_on_loop
from .call_path import MAX_LIMITER_WAIT_S, CallPath
from .call_pool import CallPool, InFlight, call_pool
from .retry import RetryPolicy, Tries, time_left_s


class ChunkRunner:
    """Makes each call of one chunk once, concurrently, under the breaker and the limiter.

    Afterwards `outcomes` holds an Outcome per sample (None: not tried, because the limiter
    asked for a long wait, see `busy_s`, or not done just before the batch deadline, so that
    the results of its chunk-mates still reach the client in time) and `retryable` the
    positions worth another try. `stop()` names why no new call may start (the batch was
    cancelled or its caller is gone; asked before each call), and `record({position:
    outcome})` gets each call's final outcomes together as it ends. Each call's tokens go to
    `ledger`, which also refuses calls over the backend's budget (`over_budget` then says so).
    """

    def __init__(
        self,
        config: Backend,
        limiter: Limiter | None,
        breaker: CircuitBreaker | None,
        attempt: int,
        may_refuse: bool = True,
        deadline: float | None = None,
        stop: Callable[[], str | None] = lambda: None,
        record: Callable[[dict[int, Outcome]], None] | None = None,
        ledger: Ledger | None = None,
        batch_id: str | None = None,
    ):
        self.config, self.limiter, self.attempt = config, limiter, attempt
        self.deadline = deadline
        self.stop, self.record = stop, record
        self.path = CallPath(config, limiter, breaker, may_refuse, stop, ledger, batch_id)
        self.policy = RetryPolicy(config.retry)
        self.busy_s: float | None = None
        self.outcomes: list[Outcome | None] = []
        self.retryable: set[int] = set()

    @property
    def over_budget(self) -> bool:
        return self.path.over_budget

    def run(self, samples: list[dict]) -> ChunkRunner:
        self.outcomes = [None] * len(samples)
        client = self.path.client
        calls = deque(client.split(samples))
        if len(calls) == 1:  # one call (a function chunk, one batch): no thread hop
            self._run_call(samples, calls[0], None)
            return self
        if runs_on_loop(self.config, self.limiter):
            call_loop().run(self._run_on_loop(samples, list(calls)), time_left_s(self.deadline))
            return self
        pool = call_pool(self.config)
        self.path.observe = pool.observe
        running = InFlight()
        while calls and not self._halted() and not self.stop():
            slots = pool.take(len(calls))
            tokens = max(client.estimate_tokens([samples[i] for i in calls[k]])
                         for k in range(slots)) if self.limiter else 0
            try:
                grants = self._grants(slots, tokens)
            except LimiterBusy as busy:
                self.busy_s = busy.wait_s
                pool.give(slots)
                break
            pool.give(slots - len(grants))
            for grant in grants:
                call = partial(self._slot, pool, samples, calls.popleft(), grant)
                pool.run(running.track(call))
        try:  # calls still running past the deadline are left to `decide`
            running.wait(timeout=time_left_s(self.deadline))
        finally:
            if self.limiter is not None:
                self.limiter.flush()  # finishes held back to be sent together go now
        return self

    def _grants(self, count: int, tokens: float) -> list[Grant | None]:
        if self.limiter is None:
            return [None] * count
        return list(self.limiter.reserve(count, tokens, MAX_LIMITER_WAIT_S))

    def _slot(self, pool: CallPool, samples: list[dict], positions: list[int],
              grant: Grant | None) -> None:
        try:
            self._run_call(samples, positions, grant)
        finally:
            pool.give()

    async def _run_on_loop(self, samples: list[dict], calls: list[list[int]]) -> None:
        """Each call on the call loop, as many at once as its gate lets through; a call that
        must wait (a 429's Retry-After) or be split goes on on a thread of its own."""
        gate = call_loop().gate(self.config)

        async def one(positions: list[int]) -> None:
            async with gate:
                if self._halted():
                    return
                batch = [samples[i] for i in positions]
                started = time.monotonic()
                try:
                    result: Call | ScoringError = await self.path.call_async(batch)
                except ScoringError as exc:
                    if self._goes_on(positions, exc):
                        await asyncio.to_thread(self._run_call, samples, positions, None, exc)
                        return
                    result = exc
                self._settle(positions, result, self.attempt, _ms_since(started))

        await asyncio.gather(*(one(positions) for positions in calls))

    def _goes_on(self, positions: list[int], error: ScoringError) -> bool:
        """Whether a call that ended with `error` is made again here: after a 429's wait, or
        split in halves to isolate the bad item of a batch (never a judge's group)."""
        return isinstance(error, RateLimited) or (
            isinstance(error, PermanentError) and len(positions) > 1
            and not self.path.client.grouped)

    def _halted(self) -> bool:
        """No call of the chunk starts past its deadline or after a long limiter wait."""
        return self.busy_s is not None or self._past_deadline()

    def _past_deadline(self) -> bool:
        return time_left_s(self.deadline) == 0.0

    def _run_call(self, samples: list[dict], positions: list[int], grant: Grant | None,
                  first: ScoringError | None = None) -> None:
        """Make the call, again after a 429 while it may; `first`: how its first try (on the
        call loop) ended."""
        batch = [samples[i] for i in positions]
        started, tries = time.monotonic(), Tries(self.attempt)
        while True:
            try:
                if first is not None:
                    error, first = first, None
                    raise error
                call = self.path.call(batch, grant)
            except LimiterBusy as busy:  # a retry could not start soon: leave it for later
                self.busy_s = busy.wait_s
                return
            except RateLimited as exc:  # again after its wait, while attempts and time remain
                grant = None
                wait_s = self.policy.wait_after_429(exc, tries, time_left_s(self.deadline))
                if wait_s is not None:
                    time.sleep(wait_s)
                    continue
                result: Call | ScoringError = exc
            except (Cancelled, BudgetExceeded) as exc:
                result = exc
            except PermanentError as exc:
                if self._goes_on(positions, exc):
                    # isolate the bad item: split, then each half on its own
                    half = len(positions) // 2
                    self._run_call(samples, positions[:half], None)
                    self._run_call(samples, positions[half:], None)
                    return
                result = exc
            except RetryableError as exc:
                result = exc
            else:
                result = call
            break
        self._settle(positions, result, tries.attempt, _ms_since(started))

    def _settle(self, positions: list[int], result: Call | ScoringError, attempts: int,
                latency_ms: float) -> None:
        """Each position's outcome of its call; the final ones recorded at once."""
        name = self.config.name
        if isinstance(result, ScoringError):
            for i in positions:
                self.outcomes[i] = Outcome.failed(result, name, attempts, latency_ms)
                if isinstance(result, RetryableError):
                    self.retryable.add(i)
        else:
            details = result.details or [None] * len(positions)
            for i, score, detail in zip(positions, result.scores, details, strict=True):
                self.outcomes[i] = (
                    Outcome.failed(score, name, attempts, latency_ms)
                    if isinstance(score, ScoringError)
                    else Outcome(score, "ok", name, attempts, latency_ms, detail=detail)
                )
        if self.record is not None and not isinstance(result, (RetryableError, Cancelled)):
            self.record({i: o for i in positions if (o := self.outcomes[i]) is not None})


def _ms_since(started: float) -> float:
    return round((time.monotonic() - started) * 1000, 1)
