"""The Celery glue of the worker side: the score_chunk task, which runs a chunk and does what
the retry policy decides with what is left.

score_chunk (message.py: its kwargs, checked) -> ChunkRunner (chunk_runner.py): the chunk's
    calls on the process's call loop (call_loop.py; a local kind's on the call pool,
    call_pool.py), each through breaker, limiter, clearance and transport (call_path.py); a
    429 is tried again in its call (retry.py); a straggler is handed off (its call goes on,
    the task comes back for it)
-> RetryPolicy.decide (retry.py, pure): what becomes of what is left: wait out a long limiter
   wait, retry here after a backoff, fail over onto a sibling backend's queue, or give up with
   explicit outcomes
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial, wraps
from typing import Any

import redis
from celery.exceptions import Reject, Retry
from celery.signals import task_received

from .. import keys
from ..backends import make_backend
from ..background import PerProcess
from ..broker import records
from ..broker.app import QrqCelery
from ..errors import Cancelled, DeadlineExceeded, TransientError
from ..message import TASK_NAME, ChunkMessage, summary
from ..ops import liveness, metrics
from ..planning import capacity
from ..planning.routing import failover_target
from ..priority import stamped
from ..samples import Outcome
from .chunk_runner import ChunkRunner
from .retry import RetryPolicy, time_left_s

# The start of a chunk's outcomes that Flower and the task-succeeded event show: Celery walks
# the result to build it, per task (at its default, 1,024 characters, 0.2 ms per sample).
RESULT_REPR_CHARS = 200
MAX_TASK_RETRIES = 100


def score_chunk(self, **kwargs: Any) -> list[dict]:
    """Score a chunk's samples on its backend; one outcome dict per sample, in input order
    (the kwargs: `message.ChunkMessage`).

    `done` carries outcomes settled by earlier runs of this task (after a backoff, a long
    limiter wait, a failover or a straggler's hand-off), so a retried task scores only what is
    left. `batch` and `indices` (the samples' places in it) tie the task to its batch's lease
    (no call for a batch nobody waits for) and per-sample records (no call for a sample
    already scored).
    """
    msg = ChunkMessage.from_kwargs(kwargs)
    app, backend, samples = self.app, msg.backend, msg.samples
    config = app.backend_config(backend)
    done: list[dict | None] = list(msg.done) if msg.done else [None] * len(samples)
    todo = [i for i, o in enumerate(done) if o is None]
    level = _level(self.request)
    requeued = partial(_requeued, app, job=msg.job, level=level)
    stop = partial(app.batch_watch.stop_reason, msg.batch)
    todo, why = _begin(app, msg, config.queue, todo, done, level)
    recorder = None
    if msg.batch is not None and msg.indices is not None:
        recorder = records.Recorder(app.store, msg.batch, msg.deadline,
                                    paid=partial(app.flow.ledger(backend).stage_batch, msg.batch))
    attempt = msg.attempt
    if why:  # a queued chunk of a cancelled or abandoned batch: dropped, nothing called
        return _cancelled(done, todo, why, backend, attempt)
    siblings = [b for b in msg.route if b != backend and b not in msg.tried]
    breaker = app.flow.breaker(backend) if len(msg.route) > 1 else None
    left: dict[int, Outcome | None] = {}
    handoff_s = 0.0
    unusable = config.missing_api_key()
    if unusable:  # a backend-level failure: no call is made, the work fails over at once
        left = {pos: Outcome.failed(TransientError(unusable), backend, attempt) for pos in todo}
        busy_s, circuit_open, attempt = None, True, max(attempt, config.retry.attempts)
    else:
        indices = msg.indices
        record = None if recorder is None or indices is None else (
            lambda outcomes: recorder.record_all(
                {indices[todo[k]]: o.to_dict() for k, o in outcomes.items()}))
        try:
            result = ChunkRunner(
                config, app.flow.limiter(backend), breaker, attempt, bool(siblings), msg.deadline,
                stop, record, app.flow.ledger(backend), msg.batch, msg.job,
            ).run(_with_level(config, self.request, [samples[i] for i in todo]))
        finally:  # the backend's and job's totals follow within the ledger's flush period
            if recorder is not None:
                recorder.flush()
        for k, pos in enumerate(todo):
            outcome = result.outcomes[k]
            if outcome is None or k in result.retryable or k in result.handed_off:
                left[pos] = None if k in result.handed_off else outcome
            else:
                done[pos] = outcome.to_dict()
        # a call tried again in its run spent attempts of the task's: the task goes on from
        # the most any sample left has spent (its retry or failover counts them)
        attempt = max([attempt, *(o.attempts for o in left.values() if o is not None)])
        handoff_s = result.handoff_s if result.handed_off else 0.0
        busy_s, circuit_open = result.busy_s, breaker is not None and breaker.is_open()
        # over budget: a sibling may take the work at once; without one the budget's error
        # stands (waiting here would not make the budget any larger)
        circuit_open = circuit_open or result.over_budget
        if result.over_budget and not siblings:
            attempt = max(attempt, config.retry.attempts)
    why = stop() if left else None
    if why:  # nobody waits for what is left: no retry, no failover
        return _cancelled(done, list(left), why, backend, attempt)
    nxt = RetryPolicy(config.retry).decide(
        len(left),
        attempt,
        time_left_s(msg.deadline),
        busy_s,
        bool(siblings),
        bool(siblings) and circuit_open,
    )
    if handoff_s:
        # stragglers' calls go on after this run: the task comes back once they have surely
        # ended (their outcomes recorded) and settles them with whatever else is left (a
        # sample whose attempts are spent is settled now: the come-back would call it again)
        _give_up_spent(left, done, config.retry.attempts, backend)
        metrics.record_retry(backend, "straggler")
        requeued(config.queue, len(left))
        # (a straggler handed off during a backoff gets its last attempt there, not one more)
        come_back = min(attempt + 1, config.retry.attempts)
        raise _retry(self, kwargs=msg.retried(done=done, attempt=come_back),
                     countdown=max(handoff_s, nxt.countdown), **summary(backend, samples))
    if nxt.action == "done":
        return _settled(done)
    if nxt.action in ("wait", "retry"):  # no sample is tried here more than attempts allow
        _give_up_spent(left, done, config.retry.attempts, backend)
        if not left:
            return _settled(done)
        metrics.record_retry(backend, "limiter_busy" if nxt.action == "wait" else "backoff")
        requeued(config.queue, len(left))
        raise _retry(self, kwargs=msg.retried(
            done=done, attempt=attempt + 1 if nxt.action == "retry" else attempt),
            countdown=nxt.countdown, **summary(backend, samples))
    if nxt.action == "failover":
        target = failover_target(siblings, *capacity.of(app, siblings), len(left))
        metrics.record_retry(backend, "failover", to=target)
        requeued(app.backend_config(target).queue, len(left))
        raise _retry(
            self,
            kwargs=msg.retried(done=done, backend=target, attempt=1, tried=[*msg.tried, backend]),
            queue=app.backend_config(target).queue,
            countdown=0,
            **summary(target, samples),
        )
    tried_here = "no call made" if unusable else f"gave up after {attempt} attempt(s)"
    note = f" ({tried_here} on {backend!r}; {nxt.why})"
    for pos, outcome in left.items():
        done[pos] = _noted(outcome or Outcome.failed(
            DeadlineExceeded("not tried before the deadline"), backend, attempt), note)
    return _settled(done)


def _retry(task: Any, **options: Any) -> Retry:
    """`task.retry(**options)`. When the retry's message cannot be published (the broker is
    away), Celery drops the task (a Reject without requeue, recorded as a FAILURE): its own
    message goes back to its queue instead, and its next run skips what was recorded."""
    try:
        return task.retry(**options)
    except Reject as refused:
        raise Reject(refused.reason, requeue=True) from None


def _give_up_spent(left: dict[int, Outcome | None], done: list[dict | None], attempts: int,
                   backend: str) -> None:
    """Settle the samples of `left` whose `[retry] attempts` are spent: the task's next run
    on this backend must not call them again."""
    for pos, outcome in list(left.items()):
        if outcome is not None and outcome.attempts >= attempts:
            del left[pos]
            done[pos] = _noted(outcome, f" (gave up after {outcome.attempts} attempt(s) "
                                        f"on {backend!r}: its [retry] attempts are spent)")


def _noted(outcome: Outcome, note: str) -> dict:
    """The outcome's dict with `note` added to its error."""
    settled = outcome.to_dict()
    settled["error"] += note
    return settled


def _settled(done: list[dict | None]) -> list[dict]:
    """The task's result: every sample's outcome (a bug if one is missing)."""
    result = [o for o in done if o is not None]
    if len(result) != len(done):
        raise RuntimeError(f"score_chunk: {len(done) - len(result)} sample(s) left unsettled")
    return result


def _with_level(config, request, samples: list[dict]) -> list[dict]:
    """A kind that sends the call's priority (a judge's `priority_field`) finds its
    message's level on each sample (priority.CALL_LEVEL)."""
    if not make_backend(config).sends_priority:
        return samples
    return stamped(samples, _level(request))


def _begin(app, msg: ChunkMessage, queue: str, todo: list[int], done: list[dict | None],
           level: int | None) -> tuple[list[int], str | None]:
    """The task's first round trip: its samples taken off the queue's count, `done` filled
    from the batch's records (samples an earlier run finished), the batch's lease looked at.
    What is left to call, and why nothing may be called (None: go on). Redis away (a failover
    under way): everything left is called, the counts are off until they fade."""
    batch = msg.batch
    wanted = [msg.indices[pos] for pos in todo] if msg.indices is not None else []
    with app.store.pipeline(transaction=False) as pipe:
        capacity.QueuedSamples.of(app).stage(pipe, {queue: -len(todo)}, msg.job, level)
        at_records = len(pipe)
        if batch is not None and wanted:
            records.stage_read(pipe, batch, wanted)
        look = app.batch_watch.stage(pipe, batch) if batch is not None else None
        try:
            replies = pipe.execute() if len(pipe) else []
        except (redis.RedisError, OSError):
            replies = None
    if batch is not None and wanted and replies is not None:
        found = records.parsed(wanted, replies[at_records])
        for pos, index in zip(todo, wanted, strict=True):
            done[pos] = found.get(index)
        todo = [pos for pos in todo if done[pos] is None]
    if look is None:  # looked at lately: the last answer
        return todo, app.batch_watch.stop_reason(batch)
    return todo, look(None if replies is None else replies[-1])


def _cancelled(done: list[dict | None], positions: list[int], why: str, backend: str,
               attempt: int) -> list[dict]:
    for pos in positions:
        done[pos] = Outcome.failed(Cancelled(why), backend, attempt).to_dict()
    return _settled(done)


def _requeued(app, queue: str, n: int, job: str, level: int | None) -> None:
    """The planner's count of samples waiting in `queue`, and the job's on its level (see
    capacity.QueuedSamples). Redis away (a failover under way): the counts are off by `n`
    until they fade, the chunk goes on."""
    with contextlib.suppress(redis.RedisError, OSError):
        capacity.QueuedSamples.of(app).add({queue: n}, job, level)


def _level(request) -> int | None:
    """The task's message priority level (None when the broker did not say)."""
    level = (request.delivery_info or {}).get("priority")
    return level if isinstance(level, int) else None


# a forked child holds its own tasks, said again by its own thread
_keeper = PerProcess(partial(liveness.HeldKeeper, keys.HEARTBEAT_S))


@task_received.connect
def _mark_holder(sender, request, **_) -> None:
    """Record which worker holds each task (running, or waiting out a retry countdown), so a
    client can resubmit the tasks of a worker whose heartbeat lapsed."""
    app = sender.app
    if isinstance(app, QrqCelery) and not app.qrq_config.embedded:
        _keeper.get().received(app.store, request.id, sender.hostname, keys.HELD_TTL_S)


def _held_while_running(task: Callable) -> Callable:
    """Run `task` with its `qrq:held:` key said again while it runs (see HeldKeeper)."""

    @wraps(task)
    def run(self, *args, **kwargs):
        if self.app.qrq_config.embedded or not self.request.id:
            return task(self, *args, **kwargs)
        with _keeper.get().holding(self.app.store, self.request.id, self.request.hostname,
                             keys.HELD_TTL_S, keeps=(Retry,)):
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
