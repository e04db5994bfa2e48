"""One run of a chunk: each of its calls made once, concurrently, through the call path (on
the process's call loop for an HTTP kind, on the call pool's threads for a local one), grants
booked in bulk; what became of each sample (`ChunkResult`)."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ..backends import Call
from ..config.model import Backend
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
from ..flow.ratelimit_headers import NO_FEEDBACK
from ..flow.spend import Ledger
from ..message import DEFAULT_JOB
from ..ops import metrics
from ..samples import Outcome
from .call_loop import Slots, call_loop
from .call_path import HEDGE_OVERRUN_S, MAX_LIMITER_WAIT_S, CallPath
from .call_pool import CallPool, InFlight, call_pool
from .retry import RetryPolicy, Tries, time_left_s

# A call still running when every other call of its chunk has ended is a straggler once it
# has taken this many times the chunk's median latency (and at least STRAGGLER_MIN_S): the
# task then returns and its Celery slot takes other work while the call goes on (its outcome
# is recorded when it ends, and the task comes back for it once the call has surely ended).
STRAGGLER_FACTOR = 4.0
STRAGGLER_MIN_S = 1.0
STRAGGLER_SHARE = 0.1  # at most this share of a chunk's calls (at least one) is handed off
HANDOFF_GRACE_S = HEDGE_OVERRUN_S + 2.0  # past a handed-off call's timeout: it has ended (its
# hedge too) and its outcome is recorded by then, even on a loaded machine (the task coming
# back earlier would call it again)
STRAGGLER_CHECK_S = 0.25


@dataclass
class ChunkResult:
    """What became of each sample of a chunk run.

    `outcomes`: an Outcome per sample, None where not tried (the limiter asked for a long
    wait, see `busy_s`; not done just before the batch deadline, so that the results of its
    chunk-mates still reach the client in time) or handed off. `retryable`: positions worth
    another try. `over_budget`: a call was refused by the budget. `handed_off`: positions of
    stragglers whose calls go on after the run returned (their outcomes are recorded as they
    end); `handoff_s`: how long until each of those calls has surely ended.
    """

    outcomes: list[Outcome | None]
    retryable: set[int] = field(default_factory=set)
    busy_s: float | None = None
    over_budget: bool = False
    handed_off: set[int] = field(default_factory=set)
    handoff_s: float = 0.0


class ChunkRunner:
    """Makes each call of one chunk once, concurrently, under the breaker and the limiter.

    `stop()` names why no new call may start (the batch was cancelled or its caller is gone;
    asked before each call), and `record({position: outcome})` gets each call's final
    outcomes together as it ends. Each call's tokens go to `ledger`, which also refuses calls
    over the backend's budget.
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
        job: str = DEFAULT_JOB,
    ):
        self.config, self.limiter, self.attempt = config, limiter, attempt
        self.deadline = deadline
        self.stop, self.record = stop, record
        self.path = CallPath(config, limiter, breaker, may_refuse, stop, ledger, batch_id, job)
        self.policy = RetryPolicy(config.retry)
        self.result = ChunkResult([])

    def run(self, samples: list[dict]) -> ChunkResult:
        self.result = ChunkResult([None] * len(samples))
        calls = deque(self.path.client.split(samples))
        if len(calls) == 1:  # one call (a function chunk, one batch): no hop
            self._run_call(samples, calls[0], None)
        elif self.path.client.awaitable:
            call_loop().run(self._run_on_loop(samples, list(calls)), time_left_s(self.deadline))
        else:
            self._run_on_pool(samples, calls)
        self.result.over_budget = self.path.over_budget
        return self.result

    def _run_on_pool(self, samples: list[dict], calls: deque[list[int]]) -> None:
        client = self.path.client
        pool = call_pool(self.config)
        self.path.observe = pool.observe
        running = InFlight()
        while calls and not self._halted() and not self.stop():
            slots = pool.take(len(calls))
            try:
                tokens = max(client.estimate_tokens([samples[i] for i in calls[k]])
                             for k in range(slots)) if self.limiter else 0
                grants = self._grants(slots, tokens)
            except LimiterBusy as busy:
                self.result.busy_s = busy.wait_s
                pool.give(slots)
                break
            except BaseException:  # the slots go back whatever went wrong
                pool.give(slots)
                raise
            pool.give(slots - len(grants))
            for grant in grants:
                call = partial(self._slot, pool, samples, calls.popleft(), grant)
                pool.run(running.track(call))
        try:  # calls still running past the deadline are left to `decide`
            running.wait(timeout=time_left_s(self.deadline))
        finally:
            if self.limiter is not None:
                self.limiter.flush()  # finishes held back to be sent together go now

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
        """Each call on the call loop, as many at once as the process's slots for the backend
        let through, their grants booked together; a call that must wait (a 429's
        Retry-After) or be split goes on on a thread of its own. Returns once every call has
        ended or only stragglers are left (`_stragglers`)."""
        slots = call_loop().slots(self.config)
        self.path.observe, self.path.hedge_after_s = slots.observe, slots.hedge_after_s
        todo, running = deque(calls), _Running()
        while todo and not self._halted() and not self.stop():
            count = await slots.take(len(todo))
            try:
                grants = await self._grants_async(count, [samples[i] for i in todo[0]])
            except LimiterBusy as busy:
                self.result.busy_s = busy.wait_s
                slots.give(count)
                break
            except BaseException:  # the slots go back whatever went wrong
                slots.give(count)
                raise
            slots.give(count - len(grants))
            for grant in grants:
                positions = todo.popleft()
                running.start(positions, self._one(slots, running, samples, positions, grant))
        await running.until_stragglers(len(calls), self.config.timeout_s)
        self.result.handed_off = {i for positions in running.left for i in positions}
        self.result.handoff_s = running.handoff_s

    async def _grants_async(self, count: int, first: list[dict]) -> list[Grant | None]:
        if self.limiter is None:
            return [None] * count
        tokens = self.path.client.estimate_tokens(first)
        return list(await self.limiter.reserve_async(count, tokens, MAX_LIMITER_WAIT_S))

    async def _one(self, slots: Slots, running: _Running, samples: list[dict],
                   positions: list[int], grant: Grant | None) -> None:
        """One call on the loop, made again here after a fault while its attempts last."""
        try:
            if self._halted():
                if grant is not None:
                    grant.release(NO_FEEDBACK)
                return
            batch = [samples[i] for i in positions]
            started, tries = time.monotonic(), Tries(self.attempt)
            while True:
                try:
                    result: Call | ScoringError = await self.path.call_async(batch, grant)
                except LimiterBusy as busy:  # a try again could not start soon: left for later
                    self.result.busy_s = busy.wait_s
                    return
                except ScoringError as exc:
                    if self._goes_on(positions, exc):
                        running.unbounded()  # its end is no longer bounded by its timeout
                        await asyncio.to_thread(self._run_call, samples, positions, None,
                                                exc, tries, started)
                        return
                    wait_s = self._again_after_fault(exc, tries)
                    if wait_s is not None and await running.again(wait_s):
                        grant = None  # the call path books the next try's grant
                        continue
                    result = exc
                break
            self._settle(positions, result, tries.attempt, _ms_since(started))
        finally:
            slots.give()

    def _goes_on(self, positions: list[int], error: ScoringError) -> bool:
        """Whether a call that ended with `error` is made again here: after a 429's wait, or
        split in halves to isolate the bad item of a batch (never a judge's group)."""
        return isinstance(error, RateLimited) or (
            isinstance(error, PermanentError) and len(positions) > 1
            and not self.path.client.grouped)

    def _again_after_fault(self, error: ScoringError, tries: Tries) -> float | None:
        """How long before a call that failed with `error` is made again here (None: not
        here); counted in `qrq_retries_total{reason="fault"}`."""
        wait_s = self.policy.wait_after_fault(error, tries, time_left_s(self.deadline))
        if wait_s is not None:
            metrics.record_retry(self.config.name, "fault")
        return wait_s

    def _halted(self) -> bool:
        """No call of the chunk starts past its deadline or after a long limiter wait."""
        return self.result.busy_s is not None or self._past_deadline()

    def _past_deadline(self) -> bool:
        return time_left_s(self.deadline) == 0.0

    def _run_call(self, samples: list[dict], positions: list[int], grant: Grant | None,
                  first: ScoringError | None = None, tries: Tries | None = None,
                  started: float | None = None) -> None:
        """Make the call, again after a 429 or a fault while it may; `first`, `tries` and
        `started`: how its last try on the call loop ended, its tries there, and when the
        first began."""
        batch = [samples[i] for i in positions]
        started = time.monotonic() if started is None else started
        tries = Tries(self.attempt) if tries is None else tries
        while True:
            try:
                if first is not None:
                    error, first = first, None
                    raise error
                call = self.path.call(batch, grant)
            except LimiterBusy as busy:  # a retry could not start soon: leave it for later
                self.result.busy_s = busy.wait_s
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
            except RetryableError as exc:  # a fault: again after its backoff, while it may
                wait_s = self._again_after_fault(exc, tries)
                if wait_s is not None:
                    grant = None
                    time.sleep(wait_s)
                    continue
                result = exc
            else:
                result = call
            break
        self._settle(positions, result, tries.attempt, _ms_since(started))

    def _settle(self, positions: list[int], result: Call | ScoringError, attempts: int,
                latency_ms: float) -> None:
        """Each position's outcome of its call; the final ones recorded at once."""
        name, outcomes = self.config.name, self.result.outcomes
        if isinstance(result, ScoringError):
            for i in positions:
                outcomes[i] = Outcome.failed(result, name, attempts, latency_ms)
                if isinstance(result, RetryableError):
                    self.result.retryable.add(i)
        else:
            details = result.details or [None] * len(positions)
            for i, score, detail in zip(positions, result.scores, details, strict=True):
                outcomes[i] = (
                    Outcome.failed(score, name, attempts, latency_ms)
                    if isinstance(score, ScoringError)
                    else Outcome(score, "ok", name, attempts, latency_ms, detail=detail)
                )
        if self.record is not None and not isinstance(result, (RetryableError, Cancelled)):
            self.record({i: o for i in positions if (o := outcomes[i]) is not None})


def _ms_since(started: float) -> float:
    return round((time.monotonic() - started) * 1000, 1)


class _Running:
    """The calls of one chunk running on the loop: waited for until all have ended or only
    stragglers are left, which go on after the chunk's run returns."""

    def __init__(self) -> None:
        self._calls: dict[asyncio.Future[None], tuple[list[int], float]] = {}
        self._ended: list[asyncio.Future[None]] = []  # calls done, not looked at yet
        self._news = asyncio.Event()
        self._latencies: list[float] = []
        self._backing_off: set[asyncio.Future[None]] = set()  # calls waiting to try again
        self._unbounded = False
        self.left: list[list[int]] = []
        self.handoff_s = 0.0

    def start(self, positions: list[int], call: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(call)
        self._calls[task] = (positions, time.monotonic())
        task.add_done_callback(self._end)

    def _end(self, task: asyncio.Future[None]) -> None:
        self._ended.append(task)
        self._news.set()

    async def again(self, wait_s: float) -> bool:
        """The calling call is made again after `wait_s`, its clock restarted (a straggler is
        judged, and its handoff timed, by its latest try); False when the run handed it off
        meanwhile (the task's return to its samples makes it again)."""
        task = asyncio.current_task()
        assert task is not None  # a call's own task
        self._backing_off.add(task)
        try:
            await asyncio.sleep(wait_s)
        finally:
            self._backing_off.discard(task)
        if self.left or task not in self._calls:
            return False
        positions, _ = self._calls[task]
        self._calls[task] = (positions, time.monotonic())
        return True

    def unbounded(self) -> None:
        """A call goes on past its timeout (a 429's wait on a thread): none is handed off."""
        self._unbounded = True

    async def until_stragglers(self, calls: int, timeout_s: float) -> None:
        few = max(1, int(STRAGGLER_SHARE * calls))
        while self._calls:
            if len(self._calls) - len(self._ended) > few:  # no straggler yet: wait for news
                await self._news.wait()
            else:  # few left: look again every STRAGGLER_CHECK_S
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._news.wait(), STRAGGLER_CHECK_S)
            self._news.clear()
            done, self._ended = self._ended, []
            now = time.monotonic()
            for task in done:
                _, started = self._calls.pop(task)
                task.result()  # a bug in a call is raised in the chunk's task
                self._latencies.append(now - started)
            if self._calls and self._stragglers(calls, now):
                self.left = [positions for positions, _ in self._calls.values()]
                newest = max(started for _, started in self._calls.values())
                self.handoff_s = max(0.0, newest + timeout_s - now) + HANDOFF_GRACE_S
                return

    def _stragglers(self, calls: int, now: float) -> bool:
        """Whether the calls still running are few and far slower than the rest, each waiting
        for a reply (a call backing off is not stuck: its tries and waits are bounded)."""
        if self._unbounded or not self._latencies or self._backing_off:
            return False
        if len(self._calls) > max(1, int(STRAGGLER_SHARE * calls)):
            return False
        slow_s = max(STRAGGLER_MIN_S, STRAGGLER_FACTOR * statistics.median(self._latencies))
        return all(now - started >= slow_s for _, started in self._calls.values())
