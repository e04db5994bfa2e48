"""The Celery glue of the worker side: the score_chunk task, which runs a chunk and does what
the retry policy decides with what is left.

score_chunk (message.py: its kwargs) -> ChunkRunner (chunk_runner.py): the chunk's calls on
    the process's call pool (call_pool.py), each through breaker, limiter, clearance and
    transport (call_path.py); a 429 is tried again in its call (retry.py)
-> RetryPolicy.decide (retry.py, pure): what becomes of what is left: wait out a long limiter
   wait, retry here after a backoff, fail over onto a sibling backend's queue, or give up with
   explicit outcomes
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial, wraps

import redis

from .. import records
from ..errors import Cancelled, DeadlineExceeded, TransientError
from ..flow import capacity
from ..message import TASK_NAME, summary
from ..ops import liveness, metrics
from ..priority import stamped
from ..samples import Outcome
from ..trainer.routing import failover_target
from .chunk_runner import ChunkRunner
from .retry import RetryPolicy, time_left_s

# The start of a chunk's outcomes that Flower and the task-succeeded event show: Celery walks
# the result to build it, per task (at its default, 1,024 characters, 0.2 ms per sample).
RESULT_REPR_CHARS = 200
MAX_TASK_RETRIES = 100


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
            lambda outcomes: recorder.record_all(
                {indices[todo[k]]: o.to_dict() for k, o in outcomes.items()}))
        try:
            runner = ChunkRunner(
                config, app.limiter(backend), breaker, attempt, bool(siblings), deadline,
                stop, record, app.ledger(backend), batch,
            ).run(_with_level(config, self.request, [samples[i] for i in todo]))
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
    nxt = RetryPolicy(config.retry).decide(
        len(left),
        attempt,
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


def _with_level(config, request, samples: list[dict]) -> list[dict]:
    """A judge that sends the call's priority (`priority_field`) finds its message's
    level on each sample (priority.CALL_LEVEL)."""
    if not config.priority_field:
        return samples
    return stamped(samples, (request.delivery_info or {}).get("priority"))


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
    """The planner's count of samples waiting in `queue` (see capacity.QueuedSamples)."""
    capacity.QueuedSamples.of(app).add({queue: n})


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
    """Register the qrq tasks on `app`, where a worker starts (`qrq worker`, embedded mode's
    in-process worker); a client sends them by name (message.TASK_NAME)."""
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
