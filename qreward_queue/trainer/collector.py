"""The client's one reader per process (per Redis): it sleeps in Redis until something finishes.

Workers announce what finished on the submitting reader's inbox (broker/records.py: a stream, one
entry per records flush and per chunk task that ended). This process's reader blocks on it
(XREAD BLOCK) for every batch of the process at once, hands each batch what came for it, and
wakes early only when a batch's deadline or its watchdog's next look is due. `get()`, `await
batch`, the micro-batcher and `on_outcome` all wait on what it delivers: no caller polls.

A batch is known to the reader while outstanding; the reader keeps it alive only while it is
awaited (a batch nobody holds lets its lease lapse). With no batch left it reads on for
IDLE_S, so the last chunks' end announcements still drop their stored results.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any

import redis

from .. import background, keys
from ..broker import records
from ..broker.app import REDIS_READ_TIMEOUT_S, QrqCelery
from .per_app import PerApp

if TYPE_CHECKING:
    from .client import RewardBatch

log = logging.getLogger("qreward_queue")
MAX_BLOCK_S = REDIS_READ_TIMEOUT_S - 1.0  # a blocking read ends before the socket timeout
RETRY_S = 0.5  # a read that failed (Redis away) is tried again this soon
IDLE_S = 5.0
_REDIS_DOWN = (redis.RedisError, OSError)
_Read = tuple[bytes, list[records.Finished]]


class Reader:
    """The reader of one Redis (one app's store) in this process."""

    def __init__(self, app: QrqCelery):
        self.app, self._client = app, uuid.uuid4().hex[:12]
        self.inbox = keys.inbox(self.new_batch_id())
        self._cond = threading.Condition()
        self._batches: weakref.WeakValueDictionary[str, RewardBatch] = (
            weakref.WeakValueDictionary())
        self._awaited: dict[str, RewardBatch] = {}
        self._chores: list[Callable[[], Any]] = []
        self._writes: list[Callable[[Any], Any]] = []  # for the next read's pipeline
        self._read: Future[_Read] | None = None
        self._read_since = 0.0
        self._read_again = 0.0  # no read starts before (a failed one is tried again later)
        self._after = b"0-0"
        self._idle_since = time.monotonic()
        self._thread: threading.Thread | None = None
        self._inbox = ThreadPoolExecutor(1)  # replaced at each start of the thread

    # -- what batches and waiters ask ----------------------------------------------------------

    def new_batch_id(self) -> str:
        """A batch id that names this reader's inbox (keys.inbox), where workers announce."""
        return f"{self._client}.{uuid.uuid4().hex}"

    def add(self, batch: RewardBatch) -> None:
        """Collect `batch`'s outcomes until it is done (`drop`)."""
        with self._cond:
            self._batches[batch.batch_id] = batch
            self._start()

    def keep(self, batch: RewardBatch) -> None:
        """`batch` is awaited: keep it alive until it is done."""
        with self._cond:
            if batch.batch_id in self._batches:
                self._awaited[batch.batch_id] = batch

    def drop(self, batch_id: str) -> None:
        with self._cond:
            self._batches.pop(batch_id, None)
            self._awaited.pop(batch_id, None)
            if not self._batches:
                self._idle_since = time.monotonic()

    def soon(self, chore: Callable[[], Any]) -> None:
        """Run `chore` (Redis work, e.g. a cancel) on the reader's thread, not the caller's."""
        with self._cond:
            self._chores.append(chore)
            self._start()
            self._cond.notify()

    def with_next_read(self, write: Callable[[Any], Any]) -> None:
        """Queue `write(pipe)` (Redis writes nobody waits for: a batch's lease ended, results
        read) on the pipeline of the reader's next read: no round trip of its own, and
        none that holds up the deliveries after it. Redis away: the write is dropped."""
        with self._cond:
            self._writes.append(write)
            self._start()
            self._cond.notify()

    # -- the reader's thread -------------------------------------------------------------------

    def _start(self) -> None:
        if self._thread is None:
            # the blocking read runs on a thread of its own: a frozen Redis never holds the
            # reader past a deadline, and a long block holds none of redis_wait's helpers
            self._inbox = ThreadPoolExecutor(1, thread_name_prefix="qrq-inbox")
            self._thread = background.thread("qrq-reader", self._run)

    def _run(self) -> None:
        try:
            self._serve()
        except RuntimeError as exc:
            if not _exiting(exc):
                raise  # the interpreter is exiting: nobody waits any more, the reader ends

    def _serve(self) -> None:
        while True:
            with self._cond:
                chores, batches = self._wait()
                if chores is None:
                    self._thread = None
                    self._inbox.shutdown(wait=False)
                    return
            for chore in chores:
                _safely(chore)
            if self._read is not None and self._read.done():
                self._deliver(self._read, batches)
                self._read = None
            now = time.time()
            for batch in batches:
                if batch.due() <= now:
                    _safely(batch.tick)
            mono = time.monotonic()
            if self._read is None and mono >= self._read_again and (
                    batches or self._writes or mono - self._idle_since < IDLE_S):
                self._start_read(batches)

    def _wait(self) -> tuple[list[Callable[[], Any]] | None, list[RewardBatch]]:
        """Under the lock: until a chore, the read's answer, a due batch or the time to read
        again; None for the chores once idle long enough (the thread then ends)."""
        while True:
            batches = list(self._batches.values())
            chores, self._chores = self._chores, []
            now, mono = time.time(), time.monotonic()
            idle = not batches and mono - self._idle_since >= IDLE_S
            if chores:
                return chores, batches
            if idle and self._read is None and not self._writes:
                return None, batches
            due = min((b.due() for b in batches), default=now + IDLE_S)
            if self._read is None:
                if mono < self._read_again:
                    due = min(due, now + max(0.0, self._read_again - mono))
                else:
                    return [], batches
            elif self._read.done():
                return [], batches
            if due <= now:
                return [], batches
            self._cond.wait(due - now)

    def _start_read(self, batches: list[RewardBatch]) -> None:
        now = time.time()
        block_s = min((b.due() for b in batches), default=now + IDLE_S) - now
        block_ms = int(min(MAX_BLOCK_S, max(0.0, block_s)) * 1000)
        store, inbox, after = self.app.store, self.inbox, self._after
        self._read_since = now
        with self._cond:
            writes, self._writes = self._writes, []
        self._read = self._inbox.submit(records.read_inbox, store, inbox, after, block_ms,
                                        self.app.qrq_config.embedded, writes)
        self._read.add_done_callback(lambda _: self._notify())

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify()

    def _deliver(self, read: Future[_Read], batches: list[RewardBatch]) -> None:
        try:
            self._after, finished = read.result()
        except _REDIS_DOWN as exc:
            self._read_again = time.monotonic() + RETRY_S
            for batch in batches:
                batch.outage(exc, self._read_since)
            return
        for batch in batches:
            batch.reachable()
        arrived: dict[str, tuple[list[tuple[int, dict]], list[str]]] = {}
        for entry in finished:
            logged, ended = arrived.setdefault(entry.batch_id, ([], []))
            logged += entry.records
            if entry.task_id:
                ended.append(entry.task_id)
        for batch_id, (logged, ended) in arrived.items():
            found = self._batches.get(batch_id)
            if found is not None:
                _safely(partial(found.arrived, logged, ended))
        every_ended = [t for _, tasks in arrived.values() for t in tasks]
        if every_ended:  # read (when needed) by now: the expiry stays as the safety net
            self.with_next_read(partial(self.app.backend.stage_forget, every_ended))


def _safely(fn: Callable[[], Any]) -> None:
    """A bug met for one batch must not stop the reader that every batch waits on."""
    try:
        fn()
    except Exception as exc:
        if _exiting(exc):
            raise
        log.exception("qrq: the client's reader met an error (it goes on)")


def _exiting(exc: BaseException) -> bool:
    """The interpreter is exiting: concurrent.futures refuses new work from then on."""
    return isinstance(exc, RuntimeError) and "after" in str(exc) and "shutdown" in str(exc)


_readers = PerApp(Reader)


def reader(app: QrqCelery) -> Reader:
    """This process's reader of `app`'s Redis."""
    return _readers.get(app)
