"""submit_batch and RewardBatch: the trainer's side of the data path.

validate -> dedup -> cache lookup -> plan chunks over the route (weight x free capacity;
   a judge's groups whole: routing.units, cache.unit_keys; an ensemble route's samples as
   vote-samples on their judges: ensemble.Ballot)
-> RewardBatch, a facade over
   Publisher (publisher.py): score_chunk tasks on per-backend priority queues, the lease held
      while they are out (cancel() or an interrupted wait ends it, and workers then make no
      new call for the batch)
   the process's reader (collector.py): sleeps in Redis until workers announce finished
      samples and ended tasks, and puts each outcome back at its input index(es) through
      the batch's Placement (placement.py; an ensemble's sample once its votes are in)
   Watchdog (watchdog.py): work that will never come back is sent again; a queue no worker
      serves is said out loud
   and caches new scores and honours the deadline
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any, Literal

import kombu.exceptions
import redis
from celery.states import READY_STATES

from ..broker import lease, records, redis_wait
from ..broker.app import REDIS_READ_TIMEOUT_S, QrqCelery
from ..broker.cache import ScoreCache, record_cache, reward_identity, unit_keys
from ..config import redis_conn
from ..config.model import Config, Route
from ..config.redis_conn import redis_problem
from ..errors import (
    Cancelled,
    DeadlineExceeded,
    InvalidSamples,
    JobBudgetExceeded,
    RedisUnreachable,
    ScoringError,
)
from ..flow import spend
from ..message import DEFAULT_JOB
from ..ops import job_spend
from ..planning.capacity import route_shares
from ..planning.routing import Chunk, plan, plan_dealt, units
from ..priority import Priority
from ..samples import Outcome, summarize, validate_samples
from . import collector, integrity, shares
from .placement import Placement
from .publisher import Publisher
from .runtime import get_app
from .watchdog import Watchdog

ABANDON_WAIT_S = 5.0  # Ctrl-C while submitting: how long the publish under way may end first


class RewardBatch:
    """Scores of one submitted batch, in input order.

    `get()` blocks until every sample has an outcome or the deadline passes (unfinished samples
    then come back as `timeout` with the fallback score); `await batch` does the same without
    blocking the event loop. Results that will never come (Redis lost its data, the worker
    running a task died) are noticed and the work is sent again before the deadline.

    `cancel()` stops what is left (its samples come back `cancelled`); it also happens by
    itself when a wait is interrupted (Ctrl-C, an exception), when a `with` block around the
    batch raises, and when every awaiter of the batch is cancelled. A client that dies stops
    renewing the batch's lease, and workers stop calling for it within `lease_s`.

    Outcomes come in as their samples finish (`partial()`, `completed`, `on_outcome`), not
    only when their whole chunk does. An outcome once handed over is never replaced: should a
    sample be scored twice (a chunk sent again while its first run still went on), the first
    outcome to arrive is the one the batch keeps, its cache entry included.

    Inside, a facade: a Publisher sends the chunks and holds the lease, the process's reader
    (collector.py) delivers what workers announce and places it through the batch's
    Placement, and a Watchdog finds what no worker will announce (lost chunks, no worker).

    Example:
        >>> batch = submit_batch([{"prompt": "2+2?", "response": "4"}], route="math")
        >>> batch.get()
        [1.0]
    """

    def __init__(
        self,
        app: QrqCelery,
        route: Route,
        samples: Sequence[dict[str, Any]],
        outcomes: list[Outcome | None],
        copies: dict[int, list[int]],
        cache: ScoreCache | None,
        priority: int,
        deadline: float,
        cache_keys: dict[int, str] | None = None,
        job: str = DEFAULT_JOB,
    ):
        self.app, self.route, self.samples = app, route, samples
        self.priority, self.deadline, self.cache = priority, deadline, cache
        self._reader = collector.reader(app)
        self.batch_id = self._reader.new_batch_id()
        self._placement = Placement(samples, copies, app.qrq_config.fallback_score,
                                    cache_keys or {},
                                    lambda outcome: integrity.on_injection(route, outcome))
        for i, outcome in enumerate(outcomes):
            if outcome is not None:
                self._placement.place(i, outcome)
        self.job = job
        self._publisher = Publisher(app, route, self.batch_id, priority, deadline, job)
        self._watchdog = Watchdog(app, route, self._publisher)
        self._gate = shares.gate(app)
        self._lock = threading.RLock()  # the reader's thread and the caller's both place
        self._pending: dict[str, Chunk] = {}
        self._held: set[str] = set()  # pending chunks the gate holds, not yet published
        self._task_of: dict[int, str] = {}  # a position of the work -> the task scoring it
        self._settled = threading.Event()  # nothing pending (cleared while chunks are out)
        self._settled.set()
        self._watchers: list[Future[list[Outcome]]] = []
        self._outage = redis_wait.Outage(redis_conn.describe(app.qrq_config))
        self.resubmitted = 0
        self._started = time.monotonic()
        self._finished: float | None = None

    def __len__(self) -> int:
        return len(self._placement.outcomes)

    @property
    def completed(self) -> int:
        """Samples with an outcome so far (never blocks: the process's reader places them)."""
        return sum(o is not None for o in self._placement.outcomes)

    def done(self) -> bool:
        """True once every sample has an outcome (never blocks)."""
        return not self._pending

    def summary(self) -> dict[str, Any]:
        """What a trainer logs per step once every outcome is in (`get()` returned):
        `samples.summarize` of the outcomes, plus wall time from submit, the tasks
        resubmitted after a lost worker, and `spend`: per backend the calls made for this
        batch, their tokens in and out (`estimated_calls`: replies without usage, counted at
        their estimate) and, with a price in the backend file, their cost."""
        end = self._finished or time.monotonic()
        spent: dict[str, dict[str, Any]] = {}
        with contextlib.suppress(redis.RedisError, OSError):  # Redis away: no spend to show
            spent = self._within(lambda: spend.batch_spend(self.app.store, self.batch_id))
        outcomes = self._placement.outcomes
        return {
            **summarize([o for o in outcomes if o is not None]),
            "samples": len(outcomes),
            "wall_s": round(end - self._started, 3),
            "resubmitted_tasks": self.resubmitted,
            "spend": spent,
        }

    def partial(self) -> list[Outcome | None]:
        """The outcomes so far, in input order (None: not yet); never blocks."""
        return list(self._placement.outcomes)

    def on_outcome(self, callback: Callable[[int, Outcome], None]) -> None:
        """Call `callback(index, outcome)` for each outcome as it comes in, and at once for
        those already in. It runs on the process's reader thread (or the thread that cancels
        or expires the batch): keep it short."""
        with self._lock:
            self._placement.listeners.append(callback)
            for i, outcome in enumerate(self._placement.outcomes):
                if outcome is not None:
                    callback(i, outcome)

    def outcomes(self, timeout: float | None = None) -> list[Outcome]:
        """Full outcome records in input order; see `get` for the waiting rules. A wait that
        is interrupted (KeyboardInterrupt, any exception) cancels the batch first."""
        stop = self.deadline if timeout is None else min(self.deadline, time.time() + timeout)
        try:
            self._settled.wait(max(0.0, stop - time.time()))
            if self._pending and time.time() >= self.deadline:
                self._expire()  # the reader is late (a frozen Redis held it): the deadline holds
        except BaseException:
            self.cancel()
            raise
        if self._pending:
            raise TimeoutError(
                f"{len(self._pending)} task(s) unfinished after {timeout} s "
                f"(the batch deadline is later; call get() again)"
            )
        return list(self._placement.outcomes)  # type: ignore[arg-type]

    def cancel(self) -> int:
        """Give up on what is not scored yet; returns how many samples that was.

        Workers make no new call for the batch from the moment they see it (within about a
        second) and drop its queued chunks. Outcomes already in, including samples finished
        inside chunks still running, are kept; the rest come back `cancelled`.
        """
        with self._lock:
            if not self._pending:
                return 0
            self._ungate()
            pending = {t: c for t, c in self._pending.items() if t not in self._held}
            positions = [p for c in self._pending.values() for p in c.indices]

            def stop_and_read() -> tuple[dict[str, dict[str, Any]], dict[int, dict[str, Any]]]:
                self._publisher.end(lease.CANCELLED)
                metas = self._publisher.results(list(pending))
                return metas, records.read(self.app.store, self.batch_id, positions)

            metas, recorded = {}, {}
            with contextlib.suppress(redis.RedisError, OSError):  # Redis away: cancel anyway
                metas, recorded = self._within(stop_and_read)
            self._ended(metas)
            why = Cancelled("cancelled by the caller before it was scored")
            cancelled = 0
            for p in positions:
                if p in recorded:
                    self._placement.fill(p, Outcome.from_dict(recorded[p]))
                else:
                    cancelled += self._placement.fill(p, Outcome.failed(why))
            self._pending.clear()
            self._finish()
            return cancelled

    def __enter__(self) -> RewardBatch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Leaving a `with` block, by an exception or not, cancels what is still unscored."""
        self.cancel()

    def get(self, timeout: float | None = None) -> list[float]:
        """Scores in input order; raises TimeoutError if `timeout` ends before the deadline."""
        return [o.reward for o in self.outcomes(timeout)]

    scores = get

    async def outcomes_async(self, timeout: float | None = None) -> list[Outcome]:
        """`outcomes()` for asyncio: the process's reader resolves every awaiter."""
        from . import aio

        return await aio.outcomes(self, timeout)

    def __await__(self) -> Generator[Any, None, list[float]]:
        async def scores() -> list[float]:
            return [o.reward for o in await self.outcomes_async()]

        return scores().__await__()

    def watch(self) -> Future[list[Outcome]]:
        """A Future resolved with the outcomes once every one is in (or the batch's error);
        cancel it to stop waiting. The batch is kept alive while watched."""
        future: Future[list[Outcome]] = Future()
        with self._lock:
            if self._pending:
                self._watchers.append(future)
                self._reader.keep(self)
                return future
        future.set_result(list(self._placement.outcomes))  # type: ignore[arg-type]
        return future

    def unwatch(self, future: Future[list[Outcome]], cancel_if_last: bool) -> None:
        """`future` waits no more; with `cancel_if_last`, nobody waiting any more cancels the
        batch (on the reader's thread: the caller may be an event loop)."""
        with self._lock:
            if future not in self._watchers:
                return
            self._watchers.remove(future)
            if cancel_if_last and not self._watchers and self._pending:
                self._reader.soon(self.cancel)

    # -- sending -------------------------------------------------------------------------------

    def vote(self, todo: list[int]) -> list[Chunk]:
        """An ensemble route: the chunks of `todo`'s vote-samples, each on the backend that
        casts it (see ensemble.Ballot); their outcomes are aggregated as they come in."""
        return plan_dealt(self.app.qrq_config, self._placement.vote(self.route, todo))

    def send(self, chunks: list[Chunk]) -> None:
        """Publish one score_chunk task per chunk; a chunk for a backend with a rate limit goes
        through the process's gate (fair shares between jobs: shares.py), which publishes it
        as the job's share allows. The process's reader collects them."""
        if not chunks:
            return
        messages = {uuid.uuid4().hex: chunk for chunk in chunks}
        gate = self._gate
        held = {t: c for t, c in messages.items() if gate is not None and gate.shares(c.backend)}
        with self._lock:
            self._settled.clear()
            self._pending.update(messages)  # unsent, they are found lost and sent again
            self._task_of.update((p, t) for t, c in messages.items() for p in c.indices)
            self._held.update(held)
        self._reader.add(self)
        if gate is not None and held:
            gate.hold(self, self.priority, self.job, held)
        if len(held) < len(messages):
            self._publish({t: c for t, c in messages.items() if t not in held})

    def publish(self, messages: dict[str, Chunk]) -> int:
        """The gate's turn for `messages`: those the batch still waits for are sent; returns
        the samples of the others (not sent)."""
        with self._lock:
            wanted = {t: c for t, c in messages.items() if t in self._held and t in self._pending}
            self._held.difference_update(messages)
            if wanted:
                self._publish(wanted)
        return sum(len(c.indices) for t, c in messages.items() if t not in wanted)

    def _publish(self, messages: dict[str, Chunk]) -> None:
        placement = self._placement
        self._within(lambda: self._publisher.send(self, messages, placement.work,
                                                  placement.ballot is not None))

    # -- what the process's reader hands over (collector.Reader) -------------------------------

    def due(self) -> float:
        """When the reader must wake for this batch: its deadline or its watchdog's look."""
        if not self._pending:
            return float("inf")
        return min(self.deadline, time.time() + self._watchdog.next_look - time.monotonic())

    def arrived(self, logged: list[tuple[int, dict[str, Any]]], ended: list[str]) -> None:
        """Outcomes recorded for positions of the work, and tasks that ended: a task whose
        chunk has outcomes unrecorded (it gave up, or failed) has its result read."""
        with self._lock:
            cache = self.cache is not None
            for position, data in logged:
                self._placement.fill(position, Outcome.from_dict(data), cache)
            unread = [t for t in ended if t in self._pending
                      and not self._placement.filled(self._pending[t].indices)]
            if unread:  # Redis away: the watchdog's next look reads them
                with contextlib.suppress(redis.RedisError, OSError):
                    self._ended(self._within(lambda: self._publisher.results(unread)))
            self._settle({self._task_of.get(p) for p, _ in logged} | set(ended))

    def tick(self) -> None:
        """The deadline passed (what is missing times out), or the watchdog's look is due."""
        with self._lock:
            if not self._pending:
                return
            if time.time() >= self.deadline:
                self._expire()
                return
            out = {t: c for t, c in self._pending.items() if t not in self._held}
            try:
                metas, lost = self._within(lambda: self._watchdog.look(out))
            except (redis.RedisError, OSError) as exc:
                self.outage(exc, time.time())
                return
            self._ended(metas)
            self._settle(set(metas))
            lost = {t: c for t, c in lost.items() if t in self._pending}
            if lost and self._pending:
                for task_id in lost:
                    self._pending.pop(task_id)
                self.resubmitted += len(lost)
                with contextlib.suppress(redis.RedisError, kombu.exceptions.OperationalError,
                                         OSError):
                    self.send(list(lost.values()))

    def outage(self, exc: BaseException, since: float) -> None:
        """Redis did not answer a read that began at `since`."""
        self._outage.noticed(exc, self.deadline, since)
        self._watchdog.outage()

    def reachable(self) -> None:
        self._outage.over()

    # -- placing -------------------------------------------------------------------------------

    def _ended(self, metas: dict[str, dict[str, Any]]) -> None:
        """Place the outcomes of the pending chunks whose tasks ended (`metas`: their results);
        positions already filled keep theirs."""
        for task_id, meta in metas.items():
            chunk = self._pending.get(task_id)
            if chunk is None or meta["status"] not in READY_STATES:
                continue
            for p, outcome in zip(chunk.indices, _chunk_outcomes(chunk, meta), strict=True):
                self._placement.fill(p, outcome, self.cache is not None)

    def _settle(self, tasks: set[str | None]) -> None:
        """Chunks of `tasks` with every position filled are done; new scores are cached; with
        nothing pending any more, the batch is."""
        for task_id in tasks:
            chunk = self._pending.get(task_id or "")
            if chunk is not None and self._placement.filled(chunk.indices):
                del self._pending[task_id]  # type: ignore[arg-type]
        fresh, cache = self._placement.take_fresh(), self.cache
        if cache and fresh:  # best effort: a Redis hiccup costs a cache entry, not a score
            with contextlib.suppress(redis.RedisError, OSError):
                self._within(lambda: cache.put_many(fresh))
        if not self._pending:  # workers drop leftovers (a hedge, a duplicate) once they see it
            self._publisher.end(lease.DONE, self._reader.with_next_read)
            self._finish()

    def _expire(self) -> None:
        with self._lock:
            self._ungate()
            for chunk in self._pending.values():
                why = "no result by the batch deadline"
                no_worker = self._watchdog.no_worker
                if chunk.backend in no_worker.warned:  # so the caller's summary says why
                    why += f": {no_worker.cause(chunk.backend)}"
                for p in chunk.indices:  # where none came yet
                    self._placement.fill(p, Outcome.failed(DeadlineExceeded(why)))
            self._pending.clear()
            lease.release(self.batch_id)  # no Redis write: it may be what made us late
            self._finish()

    def _ungate(self) -> None:
        """The gate publishes none of this batch's held chunks any more."""
        if self._gate is not None:
            self._gate.drop(self)
        self._held.clear()

    def _finish(self) -> None:
        """Nothing is pending any more: waiters learn the outcomes; the reader forgets us."""
        self._ungate()
        if self._finished is None:
            integrity.after_batch(self.app, self.route, self.samples, self._placement.outcomes,
                                  submit_batch)
        self._finished = self._finished or time.monotonic()
        self._reader.drop(self.batch_id)
        self._settled.set()
        watchers, self._watchers = self._watchers, []
        outcomes = list(self._placement.outcomes)
        for future in watchers:
            with contextlib.suppress(InvalidStateError):  # its waiter gave up meanwhile
                future.set_result(outcomes)  # type: ignore[arg-type]

    def _within(self, fn: Callable[[], Any]) -> Any:
        """`fn()` (calls on Redis) waited for at most a read timeout, never past the deadline
        (embedded: in place)."""
        if self.app.qrq_config.embedded:
            return fn()
        return redis_wait.within(min(REDIS_READ_TIMEOUT_S, self.deadline - time.time()), fn)


def _chunk_outcomes(chunk: Chunk, meta: dict[str, Any]) -> list[Outcome]:
    """A finished task's outcomes, one per sample of its chunk (its failure, for each)."""
    status, result = meta["status"], meta.get("result")
    if status == "SUCCESS" and isinstance(result, list) and len(result) == len(chunk.indices):
        return [Outcome.from_dict(d) for d in result]
    error = (
        DeadlineExceeded("the task expired at the deadline")
        if status == "REVOKED"
        else ScoringError(f"task {status}: {_describe(result)}")
    )
    return [Outcome.failed(error) for _ in chunk.indices]


def _describe(result: Any) -> str:
    if isinstance(result, dict) and "exc_type" in result:
        return f"{result['exc_type']}: {result.get('exc_message')}"
    return json.dumps(result, default=str)[:300]


def submit_batch(
    samples: Sequence[dict[str, Any]],
    route: str | None = None,
    priority: Priority | str = Priority.TRAIN,
    deadline_s: float | None = None,
    on_invalid: Literal["raise", "outcome"] = "raise",
    app: QrqCelery | None = None,
    job: str | None = None,
) -> RewardBatch:
    """Queue `samples` for scoring on `route`; returns at once with a RewardBatch.

    Invalid samples raise InvalidSamples (naming every bad index) before anything is queued,
    or with `on_invalid="outcome"` come back as `error` outcomes while the rest is scored.
    Identical samples are scored once; with the route's cache on, known scores come back
    as `cached` without touching a queue. Raises RedisUnreachable (one line naming the URL)
    when distributed mode cannot reach Redis, and JobBudgetExceeded when the job has reached
    a cap of its `[jobs.<job>.budget]`.

    `job` names whose work this is (else $QRQ_JOB, else `[jobs] name`, else `default`):
    within a priority, jobs share each backend in proportion to their `[jobs.<job>] weight`,
    and spend is counted per job.
    """
    app = app or get_app()
    config = app.qrq_config
    level = Priority.parse(priority).level
    the_job = shares.job_of(app, job)
    if config.jobs.budget(the_job) and not config.embedded:
        _within_budget(app, the_job)
    if on_invalid not in ("raise", "outcome"):
        raise ValueError(f"on_invalid must be 'raise' or 'outcome', got {on_invalid!r}")
    the_route = config.route(route)
    problems = validate_samples(samples, config.max_sample_bytes, raise_errors=False)
    whole = _units(config, the_route, samples, problems)
    if problems and on_invalid == "raise":
        raise InvalidSamples(problems)
    outcomes: list[Outcome | None] = [None] * len(samples)
    for i, why in problems.items():
        outcomes[i] = Outcome.failed(ScoringError(f"invalid sample {i}: {why}"))
    first: dict[str, int] = {}
    copies: dict[int, list[int]] = {}
    for i, key in sorted(unit_keys(samples, whole).items()):
        if key in first:
            copies.setdefault(first[key], []).append(i)
        else:
            first[key] = i
    cache = (
        ScoreCache(app.store, reward_identity(config, the_route), the_route.cache_ttl_s)
        if the_route.cache
        else None
    )
    deadline = time.time() + (deadline_s if deadline_s is not None else config.deadline_s)
    made: list[RewardBatch] = []
    abandoned, finished = threading.Event(), threading.Event()  # Ctrl-C while submitting

    def queue() -> RewardBatch:
        try:
            return publish()
        finally:
            finished.set()

    def publish() -> RewardBatch:
        hits = _whole_hits(cache.get_many(list(first)), first, whole) if cache else {}
        if cache:
            record_cache(app.store, the_route.name, len(first), len(hits))
        for key, outcome in hits.items():
            outcomes[first[key]] = outcome
        todo = [i for key, i in first.items() if key not in hits]
        batch = RewardBatch(
            app, the_route, samples, outcomes, copies, cache, level, deadline,
            {i: key for key, i in first.items()}, the_job,
        )
        made.append(batch)
        if abandoned.is_set():
            return batch
        wanted = set(todo)
        gate = shares.gate(app)
        held = gate.held_samples if gate is not None else None
        batch.send(batch.vote(todo) if the_route.votes else
                   plan(config, the_route, todo, route_shares(app, the_route, len(todo), held),
                        [unit for unit in whole if unit[0] in wanted]))
        return batch

    try:  # every Redis outage at submit is one error type, whichever part met it
        try:
            return queue() if config.embedded else redis_wait.within(deadline - time.time(), queue)
        except KeyboardInterrupt:  # what was published makes no call (the lease says cancelled)
            abandoned.set()
            finished.wait(ABANDON_WAIT_S)  # the publish still going on a helper thread
            for batch in made:
                batch.cancel()
            raise
    except (redis.RedisError, kombu.exceptions.OperationalError, OSError) as exc:
        raise RedisUnreachable(redis_problem(config, exc)) from None


def _within_budget(app: QrqCelery, job: str) -> None:
    """JobBudgetExceeded when `job` has reached a cap of its budget (nothing is queued)."""
    try:
        used = job_spend.job_use(app.store, [job])[job]
    except (redis.RedisError, OSError) as exc:
        raise RedisUnreachable(redis_problem(app.qrq_config, exc)) from None
    why = job_spend.refusal(app.qrq_config, job, used)
    if why is not None:
        raise JobBudgetExceeded(why)


def _units(config: Config, route: Route, samples: Sequence[dict[str, Any]],
           problems: dict[int, str]) -> list[list[int]]:
    """The valid samples in the units the route scores in one call (see `routing.units`);
    a sample that cannot join its group (another prompt under its `group`) is one more
    problem, added to `problems`."""
    valid = [i for i in range(len(samples)) if i not in problems]
    try:
        return units(config, route, samples, valid)
    except InvalidSamples as exc:
        problems.update(exc.problems)
        return units(config, route, samples, [i for i in valid if i not in exc.problems])


def _whole_hits(hits: dict[str, Outcome], first: dict[str, int], whole: list[list[int]]
                ) -> dict[str, Outcome]:
    """Cache hits of whole units only: a group partly cached is judged again as a whole."""
    key_of = {i: key for key, i in first.items()}
    for unit in whole:
        if len(unit) > 1 and not all(key_of.get(i) in hits for i in unit if i in key_of):
            for i in unit:
                hits.pop(key_of.get(i, ""), None)
    return hits


def score(
    samples: Sequence[dict[str, Any]],
    route: str | None = None,
    priority: Priority | str = Priority.TRAIN,
    deadline_s: float | None = None,
    **kwargs: Any,
) -> list[float]:
    """Submit and wait: the scores of `samples` in input order."""
    return submit_batch(samples, route, priority, deadline_s, **kwargs).get()
