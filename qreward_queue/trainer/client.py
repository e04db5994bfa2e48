"""submit_batch and RewardBatch: the trainer's side of the data path.

validate -> dedup -> cache lookup -> plan chunks over the route (weight x free capacity;
   a judge's groups whole: routing.units, cache.unit_keys; an ensemble route's samples as
   vote-samples on their judges: ensemble.Ballot)
-> group(score_chunk...) on per-backend priority queues
-> RewardBatch: poll results, put each outcome back at its input index(es) as its sample
   finishes (the workers' record log) and as its chunk does (the task's result; an
   ensemble's sample once its votes are in, aggregated), cache new
   scores, resubmit work that will never come back, and honour the deadline
   (while outstanding it holds a lease in Redis; cancel() or an interrupted wait ends it, and
   workers then make no new call for the batch)
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future
from typing import Any, Literal

import kombu.exceptions
import redis
from celery.states import READY_STATES

from .. import keys, lease, records, redis_conn, redis_wait
from ..app import HEARTBEAT_S, REDIS_READ_TIMEOUT_S, QrqCelery
from ..cache import ScoreCache, record_cache, reward_identity, unit_keys
from ..config import Config, Route
from ..ensemble import Ballot
from ..errors import Cancelled, DeadlineExceeded, InvalidSamples, RedisUnreachable, ScoringError
from ..flow import spend
from ..flow.capacity import QueuedSamples, queue_depth, route_shares
from ..message import TASK_NAME, chunk_kwargs, summary
from ..ops.liveness import NoWorkerWatch
from ..priority import Priority
from ..runtime import get_app, redis_problem
from ..samples import Outcome, summarize, validate_samples
from . import integrity
from .routing import Chunk, plan, plan_dealt, units

POLL_INTERVAL_S = 0.02
LIVENESS_CHECK_S = 2.0
ABANDON_WAIT_S = 5.0  # Ctrl-C while submitting: how long the publish under way may end first
QUICK_POLL_S = 0.05  # done()/completed wait no longer for Redis; the read goes on meanwhile
# After Redis was away or lost its data, no task is judged lost until every worker's heartbeat
# has had time to say again what it holds (a task still running is not bought twice).
RECOVERY_GRACE_S = HEARTBEAT_S + LIVENESS_CHECK_S + 1.0


# what one poll reads: the chunks' results, the record log's new entries, the chunks lost
_Look = tuple[dict[str, dict[str, Any]], list[tuple[int, dict[str, Any]]], dict[str, Chunk]]


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
    ):
        self.app, self.route, self.samples = app, route, samples
        self.priority, self.deadline, self.cache = priority, deadline, cache
        self._copies = copies
        self._cache_keys = cache_keys or {}  # a sample's key (cache.unit_keys), where cached
        self._ballot: Ballot | None = None  # an ensemble route's votes (see `vote`)
        self._work: Sequence[dict[str, Any]] = samples  # what the chunks' indices point at
        self.batch_id = uuid.uuid4().hex
        self._outcomes: list[Outcome | None] = [None] * len(samples)
        self._listeners: list[Callable[[int, Outcome], None]] = []
        self._log_read = 0  # entries of the batch's record log placed so far
        for i, outcome in enumerate(outcomes):
            if outcome is not None:
                self._place(i, outcome)
        self._pending: dict[str, Chunk] = {}
        self._result_keys: dict[str, Any] = {}  # task id -> its result's key (built once)
        self._sentinel: str | None = None
        self._next_liveness_check = time.monotonic() + LIVENESS_CHECK_S
        self._unheld: set[str] = set()
        self._quiet_until = 0.0  # no task is judged lost before (see RECOVERY_GRACE_S)
        self._no_worker = NoWorkerWatch(app)
        # the poll's read of Redis still in flight
        self._look: Future[_Look] | None = None
        self._look_since = time.time()  # and when it began
        self._outage = redis_wait.Outage(redis_conn.describe(app.qrq_config))
        self.resubmitted = 0
        self._started = time.monotonic()
        self._finished: float | None = None

    def __len__(self) -> int:
        return len(self._outcomes)

    @property
    def completed(self) -> int:
        """Samples with an outcome so far (polls once, waiting at most QUICK_POLL_S)."""
        self._poll(until=time.time() + QUICK_POLL_S)
        return sum(o is not None for o in self._outcomes)

    def done(self) -> bool:
        """True once every sample has an outcome (polls once, waiting at most QUICK_POLL_S
        for Redis: the asyncio poller serves every batch of the process with it)."""
        self._poll(until=time.time() + QUICK_POLL_S)
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
            spent = self._within(None, lambda: spend.batch_spend(self.app.store, self.batch_id))
        return {
            **summarize([o for o in self._outcomes if o is not None]),
            "samples": len(self._outcomes),
            "wall_s": round(end - self._started, 3),
            "resubmitted_tasks": self.resubmitted,
            "spend": spent,
        }

    def partial(self) -> list[Outcome | None]:
        """The outcomes so far, in input order (None: not yet); never polls or blocks."""
        return list(self._outcomes)

    def on_outcome(self, callback: Callable[[int, Outcome], None]) -> None:
        """Call `callback(index, outcome)` for each outcome as it comes in, and at once for
        those already in. It runs on the thread that polls the batch (any wait, `done()`, the
        asyncio poller while the batch is awaited): keep it short."""
        self._listeners.append(callback)
        for i, outcome in enumerate(self._outcomes):
            if outcome is not None:
                callback(i, outcome)

    def outcomes(self, timeout: float | None = None) -> list[Outcome]:
        """Full outcome records in input order; see `get` for the waiting rules. A wait that
        is interrupted (KeyboardInterrupt, any exception) cancels the batch first."""
        stop = self.deadline if timeout is None else min(self.deadline, time.time() + timeout)
        try:
            finished = self._wait(stop)
        except BaseException:
            self.cancel()
            raise
        if not finished:
            raise TimeoutError(
                f"{len(self._pending)} task(s) unfinished after {timeout} s "
                f"(the batch deadline is later; call get() again)"
            )
        return list(self._outcomes)  # type: ignore[arg-type]

    def _wait(self, stop: float) -> bool:
        while True:
            self._poll(until=stop)
            if not self._pending:
                self._finished = self._finished or time.monotonic()
                return True
            if time.time() >= self.deadline:
                self._expire()
                return True
            if time.time() >= stop:
                return False
            time.sleep(POLL_INTERVAL_S)

    def cancel(self) -> int:
        """Give up on what is not scored yet; returns how many samples that was.

        Workers make no new call for the batch from the moment they see it (within about a
        second) and drop its queued chunks. Outcomes already in, including samples finished
        inside chunks still running, are kept; the rest come back `cancelled`.
        """
        if not self._pending:
            return 0
        store, pending = self.app.store, [i for c in self._pending.values() for i in c.indices]
        recorded: dict[int, dict[str, Any]] = {}

        def stop_and_read() -> dict[int, dict[str, Any]]:
            lease.end(store, self.batch_id, lease.CANCELLED, self._keep_s())
            self._collect(self._read_metas(dict(self._pending)))
            return records.read(store, self.batch_id, pending)

        with contextlib.suppress(redis.RedisError, OSError):  # Redis away: cancel all the same
            recorded = self._within(None, stop_and_read)
        why = Cancelled("cancelled by the caller before it was scored")
        cancelled = 0
        for chunk in self._pending.values():
            for i in chunk.indices:
                if i in recorded:
                    self._arrive(i, Outcome.from_dict(recorded[i]))
                else:
                    cancelled += self._arrive(i, Outcome.failed(why))
        self._pending.clear()
        self._finished = time.monotonic()
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
        """`outcomes()` for asyncio: one process-wide poller thread serves every awaiter."""
        from . import aio

        return await aio.outcomes(self, timeout)

    def __await__(self) -> Generator[Any, None, list[float]]:
        async def scores() -> list[float]:
            return [o.reward for o in await self.outcomes_async()]

        return scores().__await__()

    # -- sending -------------------------------------------------------------------------------

    def vote(self, todo: list[int]) -> list[Chunk]:
        """An ensemble route: the chunks of `todo`'s vote-samples, each on the backend that
        casts it (see ensemble.Ballot); their outcomes are aggregated as they come in."""
        self._ballot = Ballot(self.route, todo, len(self.samples))
        self._work = [*self.samples, *self._ballot.fan_out(self.samples)]
        return plan_dealt(self.app.qrq_config, self._ballot.dealt())

    def send(self, chunks: list[Chunk]) -> None:
        """Publish one score_chunk task per chunk, all in one batch of one producer, and
        remember which indices each answers."""
        if not chunks:
            return
        config = self.app.qrq_config
        messages = {uuid.uuid4().hex: chunk for chunk in chunks}
        self._result_keys.update((t, self.app.backend.get_key_for_task(t)) for t in messages)
        self._pending.update(messages)  # unsent, they are found lost and sent again
        if not config.embedded and not self._sentinel:  # the first send: the lease begins
            self._sentinel = keys.batch_sentinel(self.batch_id)
            lease.hold(self, self.app.store, self.batch_id, config.lease_s)

        def publish() -> None:
            expires = max(1.0, self.deadline - time.time())
            # kombu's publish batch sends every message in one pipelined round trip on Redis
            with self.app.producer_or_acquire() as producer, producer.batch():
                for task_id, chunk in messages.items():
                    samples = [self._work[i] for i in chunk.indices]
                    # a vote stays with its judge: no sibling to fail over to
                    route = [chunk.backend] if self._ballot else list(self.route.backends)
                    self.app.send_task(
                        TASK_NAME,
                        kwargs=chunk_kwargs(chunk.backend, samples, route, self.deadline,
                                            self.batch_id, list(chunk.indices)),
                        task_id=task_id,
                        producer=producer,
                        queue=config.backend(chunk.backend).queue,
                        priority=self.priority,
                        expires=expires,
                        **summary(chunk.backend, samples),
                    )
            QueuedSamples.of(self.app).published(chunks, config)  # the planner's view
            if self._sentinel:
                self._set_sentinel(self._sentinel)

        self._within(self.deadline, publish)

    def _set_sentinel(self, sentinel: str) -> None:
        """Redis losing its data (a restart without persistence) takes this key with it; the
        lease is set first, so that no worker sees the sentinel without a live lease."""
        ttl_ms = lease.key_ttl_ms(self.app.qrq_config.lease_s)
        with self.app.store.pipeline(transaction=False) as pipe:  # nx: a cancel stays
            pipe.set(keys.lease(self.batch_id), lease.LIVE, px=ttl_ms, nx=True)
            pipe.set(sentinel, 1, px=int(self._keep_s() * 1000))
            pipe.execute()

    def _keep_s(self) -> float:
        return max(1.0, self.deadline - time.time() + 60)

    # -- collecting ----------------------------------------------------------------------------

    def _poll(self, until: float | None = None) -> None:
        """Read what came back, at most until `until` (default: the deadline) or one Redis
        read timeout, whichever is first: a frozen Redis never holds the caller longer."""
        if not self._pending:
            return
        pending, wait_s = dict(self._pending), self._wait_s(until)
        try:
            if self.app.qrq_config.embedded:
                metas, logged, lost = self._look_up(pending)
            else:  # one read in flight at a time, however long Redis hangs
                if self._look is None:
                    self._look = redis_wait.submit(lambda: self._look_up(pending))
                    self._look_since = time.time()
                metas, logged, lost = redis_wait.result(self._look, wait_s)
                self._look = None
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            if self._look is not None and self._look.done():
                self._look = None  # it failed: the next poll reads afresh
            # a read cut short by the deadline (not by Redis's silence) is no news of Redis
            if wait_s >= 1.0 or not isinstance(exc, redis_wait.RedisWaitTimeout):
                self._outage.noticed(exc, self.deadline, self._look_since)
                self._no_worker.postpone()
                self._quiet_until = time.monotonic() + RECOVERY_GRACE_S
            return  # Redis is restarting or frozen: try again at the next poll, until the deadline
        self._outage.over()
        self._collect(metas, until, logged)
        if not self._pending:
            self._done(until)
        if lost and time.time() < self.deadline:
            for task_id in lost:
                self._pending.pop(task_id, None)
            self.resubmitted += len(lost)
            with contextlib.suppress(redis.RedisError, kombu.exceptions.OperationalError, OSError):
                self.send(list(lost.values()))

    def _collect(self, metas: dict[str, dict[str, Any]], until: float | None = None,
                 logged: Sequence[tuple[int, dict[str, Any]]] = ()) -> None:
        """Place the samples the workers recorded (`logged`: the log read from `_log_read` on)
        and the outcomes of the chunks whose tasks ended (`metas`); cache the new scores."""
        self._log_read += len(logged)
        fresh: dict[str, Outcome] = {}
        for i, data in logged:
            self._arrive(i, Outcome.from_dict(data), fresh)
        collected = [t for t, meta in metas.items()
                     if meta["status"] in READY_STATES and t in self._pending]
        for task_id in collected:
            chunk = self._pending.pop(task_id)
            # an ensemble's vote positions lie past the samples (its ballot counts each vote once)
            placed = all(i < len(self._outcomes) and self._outcomes[i] is not None
                         for i in chunk.indices)
            if placed:
                continue  # usual: every sample came through the log before its chunk ended
            for i, outcome in zip(chunk.indices, _chunk_outcomes(chunk, metas[task_id]),
                                  strict=True):
                self._arrive(i, outcome, fresh)
        cache = self.cache
        if cache and fresh:  # best effort: a Redis hiccup costs a cache entry, not a score
            with contextlib.suppress(redis.RedisError, OSError):
                self._within(until, lambda: cache.put_many(fresh))
        if collected:  # read once, never again: the expiry stays as the safety net
            with contextlib.suppress(redis.RedisError, OSError):
                self._within(until, lambda: self.app.backend.forget_many(collected))

    def _arrive(self, i: int, outcome: Outcome, fresh: dict[str, Outcome] | None = None
                ) -> bool:
        """An outcome for position `i` of the work (a sample, or an ensemble's vote, which
        places its sample once all its votes are in); a new real score goes into `fresh` (to
        cache). True if a sample's outcome was placed."""
        if i >= len(self.samples) and self._ballot is not None:
            counted = self._ballot.cast(i, outcome)
            if counted is None:
                return False
            i, outcome = counted
        outcome = integrity.on_injection(self.route, outcome)
        placed = self._place(i, outcome)
        if placed and fresh is not None and self.cache and outcome.status == "ok":
            fresh[self._cache_keys[i]] = outcome
        return placed

    def _done(self, until: float | None = None) -> None:
        """Every outcome is in: workers may drop any copy of the batch's work still around."""
        self._finished = self._finished or time.monotonic()
        integrity.after_batch(self.app, self.route, self.samples, self._outcomes)
        if self._sentinel:
            with contextlib.suppress(redis.RedisError, OSError):
                self._within(until, lambda: lease.end(
                    self.app.store, self.batch_id, lease.DONE, self._keep_s()))

    def _wait_s(self, until: float | None) -> float:
        """How long one wait on Redis may last: a read timeout, never past `until`."""
        until = self.deadline if until is None else min(until, self.deadline)
        return min(REDIS_READ_TIMEOUT_S, until - time.time())

    def _within(self, until: float | None, fn: Callable[[], Any]) -> Any:
        """`fn()` (calls on Redis) waited for at most `_wait_s(until)` (embedded: in place)."""
        if self.app.qrq_config.embedded:
            return fn()
        return redis_wait.within(self._wait_s(until), fn)

    def _look_up(self, pending: dict[str, Chunk]) -> _Look:
        """The chunks' results, the record log's new entries, the chunks lost. The log is read
        first: a chunk whose result is in has its records in the log read with it."""
        logged = records.read_log(self.app.store, self.batch_id, self._log_read)
        metas = self._read_metas(pending)
        lost = self._lost_chunks(metas, pending)
        self._no_worker.check(c.backend for c in pending.values())
        return metas, logged, lost

    def _read_metas(self, pending: dict[str, Chunk]) -> dict[str, dict[str, Any]]:
        backend = self.app.backend
        keys = {self._result_keys[i]: i for i in pending}
        values = backend.mget(list(keys))
        if not isinstance(values, dict):  # Redis answers a list, the in-memory cache a dict
            values = dict(zip(keys, values, strict=True))
        return {keys[k]: backend.decode_result(v) for k, v in values.items() if v}

    def _lost_chunks(
        self, metas: dict[str, dict[str, Any]], pending: dict[str, Chunk]
    ) -> dict[str, Chunk]:
        """Tasks whose result will never come: all of them when Redis lost the batch's
        sentinel; those held (running, or waiting out a retry) by a worker whose heartbeat
        lapsed; and those nobody holds while every queue of the route is empty (a message
        lost between a worker's pop and its bookkeeping, or a restart of Redis), seen so at
        two checks in a row. Nothing is judged lost until the workers' heartbeats have had
        time to say again what they hold after Redis was away or lost its data."""
        if self.app.qrq_config.embedded or time.monotonic() < self._next_liveness_check:
            return {}
        self._next_liveness_check = time.monotonic() + LIVENESS_CHECK_S
        store = self.app.store
        if self._sentinel and not store.exists(self._sentinel):
            self._set_sentinel(self._sentinel)
            self._quiet_until = time.monotonic() + RECOVERY_GRACE_S
        if time.monotonic() < self._quiet_until:
            self._unheld = set()
            return {}
        waiting = [i for i in pending if i not in metas]
        holders = dict(zip(waiting, store.mget([keys.held(i) for i in waiting]), strict=True))
        hosts = sorted({h for h in holders.values() if h})
        # redis-py types replies bytes | str; this client does not decode_responses: bytes
        alive = dict(zip(hosts, store.mget([keys.alive(h.decode()) for h in hosts]),  # type: ignore[union-attr]
                         strict=True))
        lost = {i: pending[i] for i, h in holders.items() if h and not alive[h]}
        unheld = {i for i, h in holders.items() if not h}
        if unheld and not any(
            queue_depth(store, self.app.backend_config(b).queue) for b in self.route.backends
        ):
            lost.update({i: pending[i] for i in unheld & self._unheld})
            self._unheld = unheld
        else:
            self._unheld = set()
        return lost

    def _expire(self) -> None:
        for chunk in self._pending.values():
            why = "no result by the batch deadline"
            if chunk.backend in self._no_worker.warned:  # so the caller's summary says why
                why += f": {self._no_worker.cause(chunk.backend)}"
            for i in chunk.indices:
                self._arrive(i, Outcome.failed(DeadlineExceeded(why)))  # where none came yet
        self._pending.clear()
        self._finished = time.monotonic()
        lease.release(self.batch_id)  # no Redis write: it may be what made us late

    def _place(self, i: int, outcome: Outcome) -> bool:
        """The one place an outcome gets its sample's id and, on failure, the fallback score;
        identical samples scored once get a copy each. A sample keeps the first outcome placed
        (what a trainer may already hold is never contradicted); True if this one was."""
        if self._outcomes[i] is not None:
            return False
        fallback = self.app.qrq_config.fallback_score
        for j in [i, *self._copies.get(i, ())]:
            self._outcomes[j] = outcome.placed(_id(self.samples[j]), fallback)
            for listener in self._listeners:
                listener(j, self._outcomes[j])
        return True


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
) -> RewardBatch:
    """Queue `samples` for scoring on `route`; returns at once with a RewardBatch.

    Invalid samples raise InvalidSamples (naming every bad index) before anything is queued,
    or with `on_invalid="outcome"` come back as `error` outcomes while the rest is scored.
    Identical samples are scored once; with the route's cache on, known scores come back
    as `cached` without touching a queue. Raises RedisUnreachable (one line naming the URL)
    when distributed mode cannot reach Redis.
    """
    app = app or get_app()
    config = app.qrq_config
    level = Priority.parse(priority).level
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
            {i: key for key, i in first.items()},
        )
        made.append(batch)
        if abandoned.is_set():
            return batch
        wanted = set(todo)
        batch.send(batch.vote(todo) if the_route.votes else
                   plan(config, the_route, todo, route_shares(app, the_route, len(todo)),
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


def _id(sample: Any) -> Any:
    return sample.get("id") if isinstance(sample, dict) else None


def score(
    samples: Sequence[dict[str, Any]],
    route: str | None = None,
    priority: Priority | str = Priority.TRAIN,
    deadline_s: float | None = None,
    **kwargs: Any,
) -> list[float]:
    """Submit and wait: the scores of `samples` in input order."""
    return submit_batch(samples, route, priority, deadline_s, **kwargs).get()
