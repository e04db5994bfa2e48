"""The worker side of the data path: score one chunk of samples on one backend.

score_chunk -> for each call of the chunk: limiter.acquire -> backend.call -> outcomes
            -> retryable failures: retry here (backoff), then fail over to a sibling
               backend of the route (Celery retry onto its queue), else an explicit error
"""

from __future__ import annotations

import random
import time
from contextlib import nullcontext
from functools import cache

from .backends import BackendClient, make_backend
from .config import Backend, Retry
from .errors import PermanentError, RateLimited, RetryableError, ScoringError
from .limiter import Limiter, LimiterBusy
from .samples import Outcome

TASK_NAME = "qrq.score_chunk"
MAX_THROTTLED_ATTEMPTS = 20
MAX_LIMITER_WAIT_S = 30.0


@cache
def _client(config: Backend) -> BackendClient:
    return make_backend(config)


def backoff_s(policy: Retry, attempt: int) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(cap, base * 2**(attempt-1))]."""
    delay = min(policy.backoff_cap_s, policy.backoff_base_s * 2 ** (attempt - 1))
    return random.uniform(0, delay) if policy.jitter else delay


class ChunkRunner:
    """Runs the calls of one chunk on one backend, under the global limiter, with retries."""

    def __init__(self, config: Backend, limiter: Limiter | None, deadline: float | None):
        self.config, self.limiter, self.deadline = config, limiter, deadline
        self.client = _client(config)

    busy_s: float | None = None  # set when the limiter asked for a long wait

    def run(self, samples: list[dict]) -> tuple[list[Outcome | None], set[int]]:
        """Outcomes in order (None: not tried, see busy_s) and the retryable failures."""
        outcomes: list[Outcome | None] = [None] * len(samples)
        retryable: set[int] = set()
        for positions in self.client.split(samples):
            try:
                self._run_call(samples, positions, outcomes, retryable)
            except LimiterBusy as busy:  # leave the rest (None) for a later attempt
                self.busy_s = busy.wait_s
                break
        return outcomes, retryable

    def _run_call(self, samples, positions, outcomes, retryable) -> None:
        batch = [samples[i] for i in positions]
        started, attempts, throttled = time.monotonic(), 0, 0
        while True:
            attempts += 1
            try:
                call = self._limited_call(batch)
            except RateLimited as exc:
                throttled += 1
                if throttled < MAX_THROTTLED_ATTEMPTS and self._time_left(0.0):
                    continue  # the limiter now holds everyone back for Retry-After
                error = exc
            except RetryableError as exc:
                wait = backoff_s(self.config.retry, attempts - throttled)
                if attempts - throttled < self.config.retry.attempts and self._time_left(wait):
                    time.sleep(wait)
                    continue
                error = exc
            except PermanentError as exc:
                if len(positions) > 1:  # isolate the bad item: split and retry both halves
                    half = len(positions) // 2
                    self._run_call(samples, positions[:half], outcomes, retryable)
                    self._run_call(samples, positions[half:], outcomes, retryable)
                    return
                error = exc
            else:
                latency = (time.monotonic() - started) * 1000
                for i, score, detail in zip(
                    positions, call.scores, call.details or [None] * len(positions), strict=False
                ):
                    outcomes[i] = self._outcome(score, attempts, latency, detail)
                return
            latency = (time.monotonic() - started) * 1000
            for i in positions:
                outcomes[i] = self._outcome(error, attempts, latency, error.detail)
                if isinstance(error, RetryableError):
                    retryable.add(i)
            return

    def _limited_call(self, batch: list[dict]):
        tokens = self.client.estimate_tokens(batch)
        guard = (
            self.limiter.acquire(tokens=tokens, max_wait_s=MAX_LIMITER_WAIT_S)
            if self.limiter
            else nullcontext()
        )
        with guard as grant:
            try:
                call = self.client.call(batch)
            except ScoringError as exc:
                if self.limiter:
                    self.limiter.feedback(exc.status_code, exc.headers, timed_out=exc.timed_out)
                raise
            if self.limiter:
                self.limiter.feedback(call.status_code, call.headers)
                if call.tokens is not None:
                    grant.settle(actual_tokens=call.tokens)
            return call

    def _time_left(self, needed_s: float) -> bool:
        return self.deadline is None or time.time() + needed_s < self.deadline

    def _outcome(self, result, attempts: int, latency_ms: float, detail) -> Outcome:
        if isinstance(result, ScoringError):
            return Outcome(
                score=0.0,
                status="error",
                backend=self.config.name,
                attempts=attempts,
                latency_ms=round(latency_ms, 1),
                error=str(result),
                detail=detail,
            )
        return Outcome(
            score=result,
            status="ok",
            backend=self.config.name,
            attempts=attempts,
            latency_ms=round(latency_ms, 1),
            detail=detail,
        )


def score_chunk(
    self,
    backend: str,
    samples: list[dict],
    route: list[str] | None = None,
    deadline: float | None = None,
    done: list[dict | None] | None = None,
    tried: list[str] | None = None,
) -> list[dict]:
    """Score `samples` on `backend`; one outcome dict per sample, in order.

    `done` carries outcomes already settled by earlier attempts of this task (a retry after a
    long limiter wait, or a failover), so a retried task scores only what is left.
    """
    config = self.app.backend_config(backend)
    fallback = self.app.qrq_config.fallback_score
    done = list(done) if done else [None] * len(samples)
    todo = [i for i, o in enumerate(done) if o is None]
    runner = ChunkRunner(config, self.app.limiter(backend), deadline)
    outcomes, retryable = runner.run([samples[i] for i in todo])
    for pos, outcome in zip(todo, outcomes, strict=True):
        if outcome is not None:
            outcome.score = fallback if outcome.status == "error" else outcome.score
            outcome.id = samples[pos].get("id")
            done[pos] = outcome.to_dict()
    if runner.busy_s is not None:  # a long limiter wait: free this worker slot, come back later
        raise self.retry(kwargs=dict(self.request.kwargs, done=done), countdown=runner.busy_s)
    stuck = [todo[i] for i in sorted(retryable)]
    tried = [*(tried or []), backend]
    sibling = next((b for b in (route or []) if b not in tried), None)
    if stuck and sibling is not None:
        for pos in stuck:
            done[pos] = None
        raise self.retry(
            kwargs=dict(self.request.kwargs, backend=sibling, done=done, tried=tried),
            queue=self.app.backend_config(sibling).queue,
            countdown=0,
        )
    for pos in stuck:
        done[pos]["error"] += f" (after {done[pos]['attempts']} attempts; no sibling backend left)"
    return done


def register(app) -> None:
    """Register the qrq tasks on `app` (every QrqCelery does this once)."""
    app.task(bind=True, name=TASK_NAME, max_retries=None)(score_chunk)
