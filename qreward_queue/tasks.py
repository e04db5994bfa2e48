"""The worker side of the data path: score one chunk of samples on one backend.

score_chunk -> for each call of the chunk: breaker.allow -> limiter.acquire -> backend.call
    429               -> the limiter pauses everyone for Retry-After; the call is tried again
    timeout, 5xx, ... -> Celery retry of what is left, with backoff; after `attempts`,
                         Celery retry onto a sibling backend's queue (failover)
    4xx, bad verdict  -> an explicit `error` outcome at once (a batch call is split first)
"""

from __future__ import annotations

import random
import time
from contextlib import nullcontext
from functools import cache

from .backends import BackendClient, Call, make_backend
from .breaker import CircuitBreaker
from .config import Backend, Retry
from .errors import PermanentError, RateLimited, RetryableError, ScoringError, TransientError
from .limiter import Limiter, LimiterBusy
from .routing import failover_target
from .samples import Outcome

TASK_NAME = "qrq.score_chunk"
MAX_THROTTLED_CALLS = 20
MAX_LIMITER_WAIT_S = 30.0
MAX_TASK_RETRIES = 100


@cache
def _client(config: Backend) -> BackendClient:
    return make_backend(config)


def backoff_s(policy: Retry, attempt: int) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(cap, base * 2**(attempt-1))]."""
    delay = min(policy.backoff_cap_s, policy.backoff_base_s * 2 ** (attempt - 1))
    return random.uniform(0, delay) if policy.jitter else delay


class ChunkRunner:
    """Makes each call of one chunk once, under the breaker and the global limiter.

    Afterwards `outcomes` holds an Outcome per sample (None: not tried because the limiter
    asked for a long wait, see `busy_s`) and `retryable` the positions worth another try.
    """

    def __init__(
        self,
        config: Backend,
        limiter: Limiter | None,
        breaker: CircuitBreaker | None,
        attempt: int,
        may_refuse: bool = True,
    ):
        self.config, self.limiter, self.breaker, self.attempt = config, limiter, breaker, attempt
        self.may_refuse = may_refuse  # an open circuit refuses calls only while siblings remain
        self.client = _client(config)
        self.busy_s: float | None = None
        self.outcomes: list[Outcome | None] = []
        self.retryable: set[int] = set()

    def run(self, samples: list[dict]) -> ChunkRunner:
        self.outcomes = [None] * len(samples)
        for positions in self.client.split(samples):
            try:
                self._run_call(samples, positions)
            except LimiterBusy as busy:
                self.busy_s = busy.wait_s
                break
        return self

    def _run_call(self, samples: list[dict], positions: list[int]) -> None:
        batch = [samples[i] for i in positions]
        started, throttled = time.monotonic(), 0
        while True:
            try:
                call = self._guarded_call(batch)
            except RateLimited as exc:  # the limiter now holds everyone back; go again
                throttled += 1
                if throttled < MAX_THROTTLED_CALLS:
                    if self.limiter is None:  # nobody else waits for us: honour Retry-After
                        time.sleep(exc.retry_after_s or backoff_s(self.config.retry, throttled))
                    continue
                result: Call | ScoringError = exc
            except PermanentError as exc:
                if len(positions) > 1:  # isolate the bad item: split, then each half on its own
                    half = len(positions) // 2
                    self._run_call(samples, positions[:half])
                    self._run_call(samples, positions[half:])
                    return
                result = exc
            except RetryableError as exc:
                result = exc
            else:
                result = call
            break
        latency_ms = round((time.monotonic() - started) * 1000, 1)
        attempts = self.attempt + throttled
        if isinstance(result, ScoringError):
            for i in positions:
                self.outcomes[i] = self._error(result, attempts, latency_ms, result.detail)
                if isinstance(result, RetryableError):
                    self.retryable.add(i)
            return
        details = result.details or [None] * len(positions)
        for i, score, detail in zip(positions, result.scores, details, strict=True):
            self.outcomes[i] = (
                self._error(score, attempts, latency_ms, score.detail)
                if isinstance(score, ScoringError)
                else Outcome(score, "ok", self.config.name, attempts, latency_ms, detail=detail)
            )

    def _guarded_call(self, batch: list[dict]) -> Call:
        if self.may_refuse and self.breaker is not None and not self.breaker.allow():
            raise TransientError(f"circuit open: backend {self.config.name!r} is cooling down")
        guard = (
            self.limiter.acquire(
                tokens=self.client.estimate_tokens(batch), max_wait_s=MAX_LIMITER_WAIT_S
            )
            if self.limiter
            else nullcontext()
        )
        try:
            with guard as grant:
                return self._call(batch, grant)
        except LimiterBusy:  # the call never happened: a half-open probe goes to someone else
            if self.breaker is not None:
                self.breaker.release_probe()
            raise

    def _call(self, batch: list[dict], grant) -> Call:
        try:
            call = self.client.call(batch)
        except ScoringError as exc:
            self._learn(
                exc.status_code, exc.headers, exc.timed_out, failed=isinstance(exc, TransientError)
            )
            raise
        self._learn(call.status_code, call.headers, False, failed=False)
        if grant is not None and call.tokens is not None:
            grant.settle(actual_tokens=call.tokens)
        return call

    def _learn(self, status_code, headers, timed_out: bool, failed: bool) -> None:
        if self.limiter is not None:
            self.limiter.feedback(status_code, headers, timed_out=timed_out)
        if self.breaker is not None:  # a 429 counts as alive: flow control handles it
            self.breaker.failure() if failed else self.breaker.success()

    def _error(self, error: ScoringError, attempts: int, latency_ms: float, detail) -> Outcome:
        return Outcome(
            0.0, error.status, self.config.name, attempts, latency_ms, str(error), detail
        )


def score_chunk(
    self,
    backend: str,
    samples: list[dict],
    route: list[str] | None = None,
    deadline: float | None = None,
    done: list[dict | None] | None = None,
    tried: list[str] | None = None,
    attempt: int = 1,
) -> list[dict]:
    """Score `samples` on `backend`; one outcome dict per sample, in input order.

    `done` carries outcomes settled by earlier runs of this task (after a backoff, a long
    limiter wait or a failover), so a retried task scores only what is left.
    """
    app = self.app
    config = app.backend_config(backend)
    policy = config.retry
    done = list(done) if done else [None] * len(samples)
    todo = [i for i, o in enumerate(done) if o is None]
    siblings = [b for b in (route or []) if b != backend and b not in (tried or [])]
    breaker = app.breaker(backend) if len(route or ()) > 1 else None
    runner = ChunkRunner(config, app.limiter(backend), breaker, attempt, bool(siblings))
    runner.run([samples[i] for i in todo])
    retry_later = set()
    for k, (pos, outcome) in enumerate(zip(todo, runner.outcomes, strict=True)):
        if outcome is None or k in runner.retryable:
            retry_later.add(pos)
            continue
        done[pos] = _settled(outcome, samples[pos], app.qrq_config.fallback_score)
    if not retry_later:
        return done
    kwargs = dict(self.request.kwargs, done=done)
    time_left = deadline is None or time.time() < deadline
    if runner.busy_s is not None and time_left:  # a long limiter wait: free the slot meanwhile
        raise self.retry(kwargs=kwargs, countdown=runner.busy_s)
    circuit_open = bool(siblings) and breaker is not None and breaker.is_open()
    if attempt < policy.attempts and time_left and not circuit_open:
        raise self.retry(
            kwargs=dict(kwargs, attempt=attempt + 1), countdown=backoff_s(policy, attempt)
        )
    if siblings and time_left:
        target = failover_target(app, siblings, len(retry_later))
        raise self.retry(
            kwargs=dict(kwargs, backend=target, attempt=1, tried=[*(tried or []), backend]),
            queue=app.backend_config(target).queue,
            countdown=0,
        )
    why = "the batch deadline passed" if not time_left else "no sibling backend left"
    note = f" (gave up after {attempt} attempt(s) on {backend!r}; {why})"
    for k, pos in enumerate(todo):
        if pos in retry_later:
            outcome = runner.outcomes[k] or Outcome(
                0.0, "error", backend, attempt, error="not tried before the deadline"
            )
            done[pos] = _settled(outcome, samples[pos], app.qrq_config.fallback_score, note)
    return done


def _settled(outcome: Outcome, sample: dict, fallback: float, note: str = "") -> dict:
    """The outcome as it travels back: the sample's id, and the fallback score on errors."""
    outcome.id = sample.get("id")
    if outcome.status in ("error", "timeout"):
        outcome.score, outcome.error = fallback, f"{outcome.error}{note}"
    return outcome.to_dict()


def register(app) -> None:
    """Register the qrq tasks on `app` (every QrqCelery does this once)."""
    # score_chunk bounds its own retries (attempts, siblings, deadline); max_retries only stops
    # a poison sample that kills its pool child every time. Such a task comes back after 2 s
    # (task_retry_on_worker_lost), not after Celery's default 180 s.
    app.task(bind=True, name=TASK_NAME, max_retries=MAX_TASK_RETRIES, default_retry_delay=2)(
        score_chunk
    )
