"""The worker side of the data path: score one chunk of samples on one backend.

score_chunk -> ChunkRunner: the chunk's calls run concurrently on the process's call pool,
    each under the breaker and the global limiter (grants booked in bulk; after the call one
    round trip settles tokens, learns from the reply and releases the lease)
    429               -> the limiter pauses everyone for a usable Retry-After, else the call
                         backs off with jitter; tried again while its [retry] attempts last
                         (flow control, a shared pause or a concurrency cut, spends one
                         attempt per rate_limited_per_attempt 429s in a row)
    timeout, 5xx, ... -> left for `decide`
    4xx, bad verdict  -> an explicit `error` outcome at once (a batch call is split first)
-> decide (pure): what becomes of what is left: wait out a long limiter wait, retry here after
   a backoff, fail over onto a sibling backend's queue, or give up with explicit outcomes
"""

from __future__ import annotations

import os
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial, wraps
from typing import Literal

import redis

from . import capacity, liveness, metrics, records
from .backends import BackendClient, Call, make_backend
from .breaker import CircuitBreaker
from .config import MAX_PROCESS_CALLS, PROCESS_CALLS, Backend, Retry, advised_calls
from .errors import (
    BudgetExceeded,
    Cancelled,
    DeadlineExceeded,
    LimiterBusy,
    PermanentError,
    RateLimited,
    RetryableError,
    ScoringError,
    TransientError,
)
from .limiter import Grant, Limiter, Reading
from .routing import failover_target
from .samples import Outcome
from .spend import Booking, Ledger, Usage

TASK_NAME = "qrq.score_chunk"
# The start of a chunk's outcomes that Flower and the task-succeeded event show: Celery walks
# the result to build it, per task (at its default, 1,024 characters, 0.2 ms per sample).
RESULT_REPR_CHARS = 200
MAX_LIMITER_WAIT_S = 30.0
MAX_TASK_RETRIES = 100
RETURN_MARGIN_S = 0.5  # a chunk returns what it has this long before the batch deadline


@cache
def _client(config: Backend) -> BackendClient:
    return make_backend(config)


class CallSizing:
    """How many calls one process keeps in flight to a backend, and why.

    `[pool] calls` in the file: that many. Without it, rate x latency (Little's law, as
    `advised_calls` sizes it) once the backend has an rpm and replies have shown its latency,
    bounded by `max_concurrent` and MAX_PROCESS_CALLS (`pool.calls` then holds that bound);
    until then, and with no rpm, PROCESS_CALLS (or max_concurrent, when lower). The global
    limiter still holds the whole backend to its limits: this only decides how many calls a
    process has ready for it.
    """

    LATENCY_WEIGHT = 0.05  # of each new latency in the running mean (about the last 20 calls)

    def __init__(self, config: Backend):
        self.limits, self.most = config.limits, config.pool.calls
        self.sized = config.pool.sized
        self.latency_s: float | None = None
        if not self.sized:
            self.size, self.why = self.most, "[pool] calls in the backend file"
        elif self.most < PROCESS_CALLS:
            self.size, self.why = self.most, f"max_concurrent = {self.most}"
        else:
            self.size = PROCESS_CALLS
            self.why = ("no latency seen yet" if self.limits.rpm else
                        f"no rpm or max_concurrent: {PROCESS_CALLS}, an asyncio client's usual")

    def observe(self, latency_s: float) -> bool:
        """Learn one call's latency; True when the size changed."""
        if not self.sized or not self.limits.rpm:
            return False
        w = self.LATENCY_WEIGHT
        self.latency_s = latency_s if self.latency_s is None else (
            (1 - w) * self.latency_s + w * latency_s)
        size = min(self.most, advised_calls(self.limits, self.latency_s))
        if size == self.size:
            return False
        self.size = size
        bound = " (max_concurrent)" if size == self.limits.max_concurrent else \
            " (the process's most)" if size == MAX_PROCESS_CALLS else ""
        self.why = (f"3 x {self.limits.rpm / 60:.4g}/s x {self.latency_s * 1000:.0f} ms "
                    f"latency{bound}")
        return True


class CallPool:
    """The calls in flight to one backend from this process, shared by all its running tasks:
    `sizing.size` bounds them (a slot is taken before a grant is booked, so no lease waits
    idle), and as many threads run them, fed by a queue (lighter than an executor's future per
    call). Its threads exist, and have connected to the backend, before the first task."""

    def __init__(self, config: Backend):
        self.sizing = CallSizing(config)
        self.released = threading.Event()  # a call ended: its lease is free, poll again now
        self._free = threading.Condition()
        self._used = self._threads = 0
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._connect = _client(config).connect
        self._grow()

    def _grow(self) -> None:
        while self._threads < self.sizing.size:
            threading.Thread(target=self._serve, name=f"qrq-call-{self._threads}",
                             daemon=True).start()
            self._threads += 1

    def _serve(self) -> None:
        self._connect()  # a kept-alive connection per thread before its first call
        while True:
            self._jobs.get()()

    def run(self, job: Callable[[], None]) -> None:
        """Run `job` on one of the pool's threads (it must not raise: see `InFlight.track`)."""
        self._jobs.put(job)

    def take(self, wanted: int) -> int:
        """Block for one slot, then take up to `wanted` in all without waiting."""
        with self._free:
            while self._used >= self.sizing.size:
                self._free.wait()
            taken = min(wanted, self.sizing.size - self._used)
            self._used += taken
        return taken

    def give(self, count: int = 1) -> None:
        with self._free:
            self._used -= count
            self._free.notify(count)
        self.released.set()

    def observe(self, latency_s: float) -> None:
        """One call's latency (the backend's reply time): it may resize the pool."""
        with self._free:
            if self.sizing.observe(latency_s):
                self._grow()
                self._free.notify_all()


class InFlight:
    """The calls one chunk has running on the call pool: wait for all of them, by a deadline,
    and see the first bug one of them hit (rather than let it vanish in a pool thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._idle = threading.Event()
        self._idle.set()
        self.error: BaseException | None = None

    def track(self, call: Callable[[], None]) -> Callable[[], None]:
        with self._lock:
            self._count += 1
            self._idle.clear()

        def job() -> None:
            try:
                call()
            except BaseException as exc:  # re-raised in the chunk's own thread by `wait`
                self.error = self.error or exc
            finally:
                with self._lock:
                    self._count -= 1
                    if not self._count:
                        self._idle.set()

        return job

    def wait(self, timeout: float | None) -> None:
        self._idle.wait(timeout)
        if self.error is not None:
            raise self.error


_pools: dict[str, CallPool] = {}
_pools_lock = threading.Lock()
os.register_at_fork(after_in_child=_pools.clear)  # a pool child builds its own threads


def call_pool(config: Backend) -> CallPool:
    with _pools_lock:
        if config.name not in _pools:
            _pools[config.name] = CallPool(config)
        return _pools[config.name]


def pool_sizes() -> dict[str, dict]:
    """This process's calls in flight per backend and why (shown by `qrq status`)."""
    with _pools_lock:
        return {name: {"calls": p.sizing.size, "why": p.sizing.why} for name, p in _pools.items()}


def time_left_s(deadline: float | None) -> float | None:
    """Seconds a task may still work on its batch (None: no deadline); it stops
    RETURN_MARGIN_S early so that its result reaches the client by the deadline."""
    return None if deadline is None else max(0.0, deadline - RETURN_MARGIN_S - time.time())


def backoff_s(policy: Retry, attempt: int) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(cap, base * 2**(attempt-1))]."""
    delay = min(policy.backoff_cap_s, policy.backoff_base_s * 2 ** (attempt - 1))
    return random.uniform(0, delay) if policy.jitter else delay


class ChunkRunner:
    """Makes each call of one chunk once, concurrently, under the breaker and the limiter.

    Afterwards `outcomes` holds an Outcome per sample (None: not tried, because the limiter
    asked for a long wait, see `busy_s`, or not done just before the batch deadline, so that
    the results of its chunk-mates still reach the client in time) and `retryable` the
    positions worth another try. `stop()` names why no new call may start (the batch was
    cancelled or its caller is gone; asked before each call), and `record(position, outcome)`
    gets each final outcome as its call ends. Each call's tokens go to `ledger`, which also
    refuses calls over the backend's budget (`over_budget` then says so).
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
        record: Callable[[int, Outcome], None] | None = None,
        ledger: Ledger | None = None,
        batch_id: str | None = None,
    ):
        self.config, self.limiter, self.breaker, self.attempt = config, limiter, breaker, attempt
        self.may_refuse = may_refuse  # an open circuit refuses calls only while siblings remain
        self.deadline = deadline
        self.stop, self.record = stop, record
        self.ledger, self.batch_id = ledger, batch_id  # spend (and budget) of the calls
        self.over_budget = False
        self.client = _client(config)
        self.busy_s: float | None = None
        self.pool: CallPool | None = None  # the process's call pool, when calls go through it
        self.outcomes: list[Outcome | None] = []
        self.retryable: set[int] = set()

    def run(self, samples: list[dict]) -> ChunkRunner:
        self.outcomes = [None] * len(samples)
        calls = deque(self.client.split(samples))
        if len(calls) == 1:  # one call (a function chunk, one batch): no thread hop
            self._run_call(samples, calls[0], None)
            return self
        pool = self.pool = call_pool(self.config)
        running = InFlight()
        while calls and self.busy_s is None and not self._past_deadline() and not self.stop():
            slots = pool.take(len(calls))
            tokens = max(self.client.estimate_tokens([samples[i] for i in calls[k]])
                         for k in range(slots)) if self.limiter else 0
            try:
                grants = self._grants(slots, tokens, pool.released)
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

    def _grants(self, count: int, tokens: float, wake: threading.Event) -> list[Grant | None]:
        if self.limiter is None:
            return [None] * count
        return list(self.limiter.reserve(count, tokens, MAX_LIMITER_WAIT_S, wake))

    def _slot(self, pool: CallPool, samples: list[dict], positions: list[int],
              grant: Grant | None) -> None:
        try:
            self._run_call(samples, positions, grant)
        finally:
            pool.give()

    def _past_deadline(self) -> bool:
        return time_left_s(self.deadline) == 0.0

    def _run_call(self, samples: list[dict], positions: list[int], grant: Grant | None) -> None:
        batch = [samples[i] for i in positions]
        policy = self.config.retry
        started, spent, paced = time.monotonic(), 0, 0
        while True:
            try:
                call = self._guarded_call(batch, grant)
            except LimiterBusy as busy:  # a retry could not start soon: leave it for later
                self.busy_s = busy.wait_s
                return
            except RateLimited as exc:  # again after its wait, while attempts and time remain
                grant = None
                paced += 1  # flow control: one attempt per rate_limited_per_attempt in a row
                if not exc.flow_control or paced > policy.rate_limited_per_attempt:
                    spent, paced = spent + 1, 0
                wait_s = self._throttled_wait(exc, self.attempt + spent + paced - 1)
                left_s = time_left_s(self.deadline)
                if self.attempt + spent < policy.attempts and (
                        left_s is None or wait_s < left_s):
                    time.sleep(wait_s)
                    continue
                result: Call | ScoringError = exc
            except (Cancelled, BudgetExceeded) as exc:
                result = exc
            except PermanentError as exc:
                if len(positions) > 1:  # isolate the bad item: split, then each half on its own
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
        latency_ms = round((time.monotonic() - started) * 1000, 1)
        attempts = self.attempt + spent
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
            for i in positions:
                self.record(i, self.outcomes[i])  # type: ignore[arg-type]

    def _guarded_call(self, batch: list[dict], grant: Grant | None) -> Call:
        if self.may_refuse and self.breaker is not None and not self.breaker.allow():
            if grant is not None:
                grant.finish()
            raise TransientError(f"circuit open: backend {self.config.name!r} is cooling down")
        if grant is None and self.limiter is not None:
            try:
                (grant,) = self.limiter.reserve(
                    1, self.client.estimate_tokens(batch), MAX_LIMITER_WAIT_S
                )
            except LimiterBusy:  # the call never happens: a half-open probe goes to someone else
                if self.breaker is not None:
                    self.breaker.release_probe()
                raise
        name = self.config.name
        try:
            if grant is not None:
                grant.wait()
                metrics.record_limiter_wait(name, grant.wait_s)
            booking = self._clearance(batch)
        except BaseException as exc:  # the call is not made: its lease (and probe) go back
            if grant is not None:
                grant.finish()
            if self.breaker is not None and isinstance(exc, ScoringError):
                self.breaker.release_probe()
            raise
        started = time.monotonic()
        try:
            call = self.client.call(batch)
        except ScoringError as exc:
            self._spent(batch, None, booking, replied=200 <= (exc.status_code or 0) < 300)
            metrics.record_request(name, exc.status_code, time.monotonic() - started,
                                   "timeout" if exc.timed_out else "error")
            reading = self._learn(grant, exc.status_code, exc.headers, exc.timed_out,
                                  failed=isinstance(exc, TransientError))
            if isinstance(exc, RateLimited):
                exc.flow_control = reading.flow_control
            if reading.pause_s:  # the limiter holds everyone back: no wait of the caller's own
                exc.retry_after_s = 0.0
            raise
        except BaseException:
            self._spent(batch, None, booking, replied=False)
            if grant is not None:
                grant.finish()
            raise
        self._spent(batch, call, booking, replied=True)
        metrics.record_request(name, call.status_code, time.monotonic() - started)
        if self.pool is not None:
            self.pool.observe(time.monotonic() - started)
        if grant is not None and call.tokens is not None:
            grant.settle(actual_tokens=call.tokens)
        self._learn(grant, call.status_code, call.headers, False, failed=False)
        return call

    def _clearance(self, batch: list[dict]) -> Booking | None:
        """Whether the call may be made now: Cancelled when nobody waits for it any more,
        BudgetExceeded when it would pass the backend's budget (else its booking)."""
        stopped = self.stop()
        if stopped:
            raise Cancelled(stopped)
        if self.ledger is None:
            return None
        try:
            return self.ledger.book(Usage.estimate(*self.client.estimate_usage(batch)))
        except BudgetExceeded:
            self.over_budget = True
            raise

    def _spent(self, batch: list[dict], call: Call | None, booking: Booking | None,
               replied: bool) -> None:
        """Add the call's tokens to the spend: the reply's usage, else the estimate when the
        backend answered (it may bill), else nothing (no reply: no usage known)."""
        if self.ledger is None:
            return
        if call is not None and call.usage is not None:
            usage = Usage(*call.usage)
        elif replied and self.config.kind != "function":  # a function has no tokens
            usage = Usage.estimate(*self.client.estimate_usage(batch))
        else:
            usage = Usage(0, 0)
        self.ledger.spent(usage, booking, self.batch_id)

    def _throttled_wait(self, exc: RateLimited, attempt: int) -> float:
        """A 429'd call's own wait: Retry-After (bounded; 0 when the limiter paused everyone
        for it), else the normal backoff with jitter."""
        if exc.retry_after_s is not None:
            return exc.retry_after_s
        return backoff_s(self.config.retry, attempt)

    def _learn(self, grant: Grant | None, status_code, headers, timed_out: bool,
               failed: bool) -> Reading:
        """Tell the limiter and breaker how the call went; what the limiter made of it."""
        reading = Reading()
        if grant is not None:
            reading = grant.finish(status_code, headers, timed_out)
        elif self.limiter is not None:
            reading = self.limiter.feedback(status_code, headers, timed_out=timed_out)
        if self.breaker is not None:  # a 429 counts as alive: flow control handles it
            self.breaker.failure() if failed else self.breaker.success()
        return reading


@dataclass(frozen=True)
class Next:
    """What `score_chunk` does with the samples left after a run."""

    action: Literal["done", "wait", "retry", "failover", "give_up"]
    countdown: float = 0.0
    why: str = ""


def decide(
    left: int,
    attempt: int,
    policy: Retry,
    time_left: float | None,
    busy_s: float | None,
    has_siblings: bool,
    circuit_open: bool,
) -> Next:
    """The retry/failover decision: pure, so every branch is unit-tested on its own.

    `time_left`: seconds until the task must return (None: no deadline); a wait or backoff
    that would end after it gives up instead, so finished samples are never held back.

    >>> decide(0, 1, Retry(), 10.0, None, False, False).action
    'done'
    >>> decide(3, 4, Retry(attempts=4), 10.0, None, True, False).action
    'failover'
    """
    def fits(seconds: float) -> bool:
        return time_left is None or seconds < time_left

    if left == 0:
        return Next("done")
    if not fits(0.0):
        return Next("give_up", why="the batch deadline passed")
    if busy_s is not None:  # a long limiter wait: free the slot meanwhile
        return Next("wait", busy_s) if fits(busy_s) else Next(
            "give_up", why=f"the limiter's wait ({busy_s:.1f} s) ends after the batch deadline"
        )
    if attempt < policy.attempts and not (has_siblings and circuit_open):
        backoff = backoff_s(policy, attempt)
        if fits(backoff):
            return Next("retry", backoff)
    if has_siblings:
        return Next("failover")
    if attempt < policy.attempts:
        return Next("give_up", why="the batch deadline passed")
    return Next("give_up", why="no sibling backend left")


def score_chunk(
    self,
    backend: str,
    samples: list[dict],
    route: list[str] | None = None,
    deadline: float | None = None,
    done: list[dict | None] | None = None,
    tried: list[str] | None = None,
    attempt: int = 1,
    batch: str | None = None,
    indices: list[int] | None = None,
) -> list[dict]:
    """Score `samples` on `backend`; one outcome dict per sample, in input order.

    `done` carries outcomes settled by earlier runs of this task (after a backoff, a long
    limiter wait or a failover), so a retried task scores only what is left. `batch` and
    `indices` (the samples' places in it) tie the task to its batch's lease (no call for a
    batch nobody waits for) and per-sample records (no call for a sample already scored).
    """
    app = self.app
    config = app.backend_config(backend)
    done = list(done) if done else [None] * len(samples)
    todo = [i for i, o in enumerate(done) if o is None]
    _requeued(app, config.queue, -len(todo))
    stop = partial(app.batch_watch.stop_reason, batch)
    recorder = None
    if batch is not None and indices is not None and len(indices) == len(samples):
        todo = _skip_recorded(app, batch, indices, todo, done)
        recorder = records.Recorder(app.store, batch, deadline)
    why = stop()
    if why:  # a queued chunk of a cancelled or abandoned batch: dropped, nothing called
        return _cancelled(done, todo, why, backend, attempt)
    siblings = [b for b in (route or []) if b != backend and b not in (tried or [])]
    breaker = app.breaker(backend) if len(route or ()) > 1 else None
    left: dict[int, Outcome | None] = {}
    unusable = config.missing_api_key()
    if unusable:  # a backend-level failure: no call is made, the work fails over at once
        left = {pos: Outcome.failed(TransientError(unusable), backend, attempt) for pos in todo}
        busy_s, circuit_open, attempt = None, True, max(attempt, config.retry.attempts)
    else:
        record = None if recorder is None else (
            lambda k, outcome: recorder.record(indices[todo[k]], outcome.to_dict()))
        try:
            runner = ChunkRunner(
                config, app.limiter(backend), breaker, attempt, bool(siblings), deadline,
                stop, record, app.ledger(backend), batch,
            ).run([samples[i] for i in todo])
        finally:
            app.ledger(backend).flush()
            if recorder is not None:
                recorder.flush()
        for k, pos in enumerate(todo):
            outcome = runner.outcomes[k]
            if outcome is None or k in runner.retryable:
                left[pos] = outcome
            else:
                done[pos] = outcome.to_dict()
        busy_s, circuit_open = runner.busy_s, breaker is not None and breaker.is_open()
        # over budget: a sibling may take the work at once; without one the budget's error
        # stands (waiting here would not make the budget any larger)
        circuit_open = circuit_open or runner.over_budget
        if runner.over_budget and not siblings:
            attempt = max(attempt, config.retry.attempts)
    why = stop() if left else None
    if why:  # nobody waits for what is left: no retry, no failover
        return _cancelled(done, list(left), why, backend, attempt)
    nxt = decide(
        len(left),
        attempt,
        config.retry,
        time_left_s(deadline),
        busy_s,
        bool(siblings),
        bool(siblings) and circuit_open,
    )
    if nxt.action == "done":
        return done
    if nxt.action in ("wait", "retry"):  # no sample is tried here more than attempts allow
        for pos in [p for p, o in left.items() if o and o.attempts >= config.retry.attempts]:
            done[pos] = left.pop(pos).to_dict()
            done[pos]["error"] += (f" (gave up after {done[pos]['attempts']} attempt(s) on "
                                   f"{backend!r}: its [retry] attempts are spent)")
        if not left:
            return done
    kwargs = dict(self.request.kwargs, done=done)
    if nxt.action in ("wait", "retry"):
        metrics.record_retry(backend, "limiter_busy" if nxt.action == "wait" else "backoff")
        if nxt.action == "retry":
            kwargs["attempt"] = attempt + 1
        _requeued(app, config.queue, len(left))
        raise self.retry(kwargs=kwargs, countdown=nxt.countdown, **summary(backend, samples))
    if nxt.action == "failover":
        target = failover_target(siblings, *capacity.of(app, siblings), len(left))
        metrics.record_retry(backend, "failover", to=target)
        _requeued(app, app.backend_config(target).queue, len(left))
        raise self.retry(
            kwargs=dict(kwargs, backend=target, attempt=1, tried=[*(tried or []), backend]),
            queue=app.backend_config(target).queue,
            countdown=0,
            **summary(target, samples),
        )
    tried_here = "no call made" if unusable else f"gave up after {attempt} attempt(s)"
    note = f" ({tried_here} on {backend!r}; {nxt.why})"
    for pos, outcome in left.items():
        done[pos] = (
            outcome
            if outcome is not None
            else Outcome.failed(DeadlineExceeded("not tried before the deadline"), backend, attempt)
        ).to_dict()
        done[pos]["error"] += note
    return done


def _skip_recorded(app, batch: str, indices: list[int], todo: list[int],
                   done: list[dict | None]) -> list[int]:
    """Fill `done` from the batch's records (samples an earlier run finished); what is left."""
    try:
        recorded = records.read(app.store, batch, [indices[pos] for pos in todo])
    except (redis.RedisError, OSError):  # Redis away: calling again beats failing the task
        return todo
    for pos in todo:
        if indices[pos] in recorded:
            done[pos] = recorded[indices[pos]]
    return [pos for pos in todo if done[pos] is None]


def _cancelled(done: list[dict | None], positions: list[int], why: str, backend: str,
               attempt: int) -> list[dict]:
    for pos in positions:
        done[pos] = Outcome.failed(Cancelled(why), backend, attempt).to_dict()
    return done  # type: ignore[return-value]


def _requeued(app, queue: str, n: int) -> None:
    """The planner's count of samples waiting in `queue` (see capacity.py)."""
    if not app.qrq_config.embedded:
        capacity.count_queued(app.store, queue, n)


def summary(backend: str, samples: list) -> dict[str, str]:
    """How a task's arguments show in Flower and logs: never the prompts themselves."""
    return {"argsrepr": f"({backend!r}, <{len(samples)} samples>)", "kwargsrepr": "{}"}


_keeper = liveness.HeldKeeper(liveness.HEARTBEAT_S)


def _new_keeper() -> None:
    global _keeper
    _keeper = liveness.HeldKeeper(liveness.HEARTBEAT_S)  # the parent's thread is not in the child


os.register_at_fork(after_in_child=_new_keeper)


def _held_while_running(task: Callable) -> Callable:
    """Run `task` with its `qrq:held:` key said again while it runs (see HeldKeeper)."""

    @wraps(task)
    def run(self, *args, **kwargs):
        if self.app.qrq_config.embedded or not self.request.id:
            return task(self, *args, **kwargs)
        with _keeper.holding(self.app.store, self.request.id, self.request.hostname,
                             liveness.HELD_TTL_S):
            return task(self, *args, **kwargs)

    return run


_task_body = _held_while_running(score_chunk)  # one function for every app: no "duplicate"


def register(app) -> None:
    """Register the qrq tasks on `app` (every QrqCelery does this once)."""
    # score_chunk bounds its own retries (attempts, siblings, deadline); max_retries only stops
    # a poison sample that kills its pool child every time. Such a task comes back after 2 s
    # (task_retry_on_worker_lost), not after Celery's default 180 s.
    app.task(
        bind=True,
        name=TASK_NAME,
        max_retries=MAX_TASK_RETRIES,
        default_retry_delay=2,
        resultrepr_maxsize=RESULT_REPR_CHARS,
    )(_task_body)
