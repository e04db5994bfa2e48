"""Fair shares between jobs: the process's gate at the mouth of each backend queue.

Workers take tasks from a queue's priority level first in, first out, so a job's share of a
backend is its share of what waits in the queue (Little's law). The gate holds a batch's
chunks in this process and publishes them while its job's samples waiting on that queue and
level (published, not yet started by a worker) stay within the job's share of a small depth:
about TARGET_S of the backend's rate, split between the jobs active there in proportion to
their weights (`[jobs.<job>] weight`). A job alone gets the whole depth, so it is never
slowed; a job that starts late has its share after about one drain of the queue.

One atomic script (flow/lua/share.lua) per check: it marks the job active, reads every
active job's count, grants whole chunks and books them, so that two processes of one job do
not both use its share. Workers take a job's samples off as they start its tasks
(capacity.QueuedSamples with the message's job) and announce it on the level's `drained`
channel. While the process holds chunks, it checks when a worker announces a start (at most
every CHECK_EVERY_S), and every RECHECK_S without one (another job's share falls to this one
when it goes idle, which no worker announces), one script call per (backend, level, job) it
holds chunks for; it waits in Redis (pub/sub), not on a timer. Holding nothing, it makes no
call and listens to nothing. Embedded mode, and `[jobs] fair_shares = false`, have no gate; a
backend without an rpm limit (a local function, a judge limited by concurrency only) has no
rate to size the depth by, and its chunks are queued at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from importlib import resources
from typing import Protocol

import redis

from .. import keys
from ..background import Daemon
from ..broker.app import QrqCelery
from ..message import job_problem
from ..planning.capacity import backend_rate
from ..planning.routing import Chunk
from .per_app import PerApp

log = logging.getLogger("qreward_queue")
TARGET_S = 1.0  # what all jobs may keep waiting on a level: this long at the backend's rate
MIN_CHUNKS = 2  # ... and at least this many of the held chunks
CHECK_EVERY_S = 0.05  # the most often the gate checks
RECHECK_S = 0.5  # ... and the longest it waits for a worker's announcement to check again
IDLE_MS = 1500  # a job seen no longer than this, or with samples waiting, is active
STALE_MS = 30_000  # a job not seen this long is forgotten (its process is gone)
KEEP_S = 3600  # the level's keys fade after this long unused
RATE_EVERY_S = 1.0  # a backend's rate is read again after this long
MAX_ASKED = 64  # chunks offered per check (more are not granted in one depth anyway)


class Owner(Protocol):
    """A batch whose chunks the gate holds."""

    def publish(self, messages: dict[str, Chunk]) -> int:
        """Send those of `messages` the batch still waits for; the samples of the others."""


@dataclass(frozen=True)
class Held:
    owner: Owner
    task_id: str
    chunk: Chunk


class Gate:
    """The process's gate for one app: chunks held per (backend, level, job) in order."""

    def __init__(self, app: QrqCelery):
        self.app = app
        self._script = app.store.register_script(
            (resources.files("qreward_queue.flow") / "lua" / "share.lua").read_text())
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._held: dict[tuple[str, int, str], deque[Held]] = {}
        self._rates: dict[str, tuple[float, float]] = {}  # backend -> (read at, samples/s)
        self._thread = Daemon("qrq-shares", self._run)

    def shares(self, backend: str) -> bool:
        """Whether `backend`'s queue is shared by the gate: only a backend with an rpm limit
        has a rate to size the depth by (without one, its chunks are queued at once)."""
        return bool(self.app.qrq_config.backend(backend).limits.rpm)

    def hold(self, owner: Owner, level: int, job: str, messages: dict[str, Chunk]) -> None:
        """Publish `messages` (task id -> chunk) as `job`'s share on each queue allows: what
        it allows now at once (on the caller's thread), the rest as the queue drains."""
        slots = {(chunk.backend, level, job) for chunk in messages.values()}
        with self._lock:
            for task_id, chunk in messages.items():
                self._held.setdefault((chunk.backend, level, job), deque()).append(
                    Held(owner, task_id, chunk))
        self.check(slots)
        self._thread.ensure()
        self._wake.set()

    def drop(self, owner: Owner) -> None:
        """Forget `owner`'s held chunks (cancelled, expired or finished): never published."""
        with self._lock:
            for slot, queue in list(self._held.items()):
                kept = deque(h for h in queue if h.owner is not owner)
                if kept:
                    self._held[slot] = kept
                else:
                    del self._held[slot]

    def held(self) -> int:
        """Chunks held now (all owners)."""
        with self._lock:
            return sum(map(len, self._held.values()))

    def held_samples(self, backend: str) -> int:
        """Samples this process holds for `backend` (any level, any job): the planner counts
        them as queued there (other processes' held samples it cannot see)."""
        with self._lock:
            return sum(len(h.chunk.indices) for (name, _, _), queue in self._held.items()
                       if name == backend for h in queue)

    def check(self, only: set[tuple[str, int, str]] | None = None) -> None:
        """One look per slot (`only` those) holding chunks: publish what each job's share
        allows."""
        with self._lock:
            slots = [(slot, [h.chunk for h in list(queue)[:MAX_ASKED]])
                     for slot, queue in self._held.items() if only is None or slot in only]
        for (backend, level, job), chunks in slots:
            try:
                self._check(backend, level, job, chunks)
            except (redis.RedisError, OSError) as exc:  # Redis away: the deadline still holds
                log.debug("qrq: fair-share check for %s failed: %s", backend, exc)

    def _check(self, backend: str, level: int, job: str, chunks: list[Chunk]) -> None:
        config = self.app.qrq_config
        queue = config.backend(backend).queue
        sizes = [len(c.indices) for c in chunks]
        depth = max(self._rate(backend) * TARGET_S, MIN_CHUNKS * max(sizes))
        names = keys.share_keys(queue, level)
        granted = int(self._script(
            keys=[names["active"], names["queued"], names["weights"]],
            args=[job, config.jobs.weight(job), IDLE_MS, STALE_MS, depth, KEEP_S, *sizes]))
        if not granted:
            return
        with self._lock:
            held = self._held.get((backend, level, job), deque())
            # the slot may have lost chunks (a drop) since it was read: publish what is first
            # now, never more than was granted (a shorter grant only delays the rest)
            taken = [held.popleft() for _ in range(min(granted, len(held)))]
            if not held:
                self._held.pop((backend, level, job), None)
        by_owner: dict[int, tuple[Owner, dict[str, Chunk]]] = {}
        for h in taken:
            by_owner.setdefault(id(h.owner), (h.owner, {}))[1][h.task_id] = h.chunk
        unused = sum(sizes[:granted]) - sum(len(h.chunk.indices) for h in taken)
        for owner, messages in by_owner.values():
            try:
                unused += owner.publish(messages)
            except (redis.RedisError, OSError):  # none sent: the batch's watchdog sends again
                unused += sum(len(c.indices) for c in messages.values())
        if unused:  # booked but not published: give the share back
            self.app.store.hincrby(names["queued"], job, -unused)

    def _rate(self, backend: str) -> float:
        """Samples per second `backend` takes now (read at most every RATE_EVERY_S)."""
        read_at, rate = self._rates.get(backend, (0.0, 0.0))
        if time.monotonic() - read_at >= RATE_EVERY_S:
            rate = backend_rate(self.app, backend) / 60
            self._rates[backend] = (time.monotonic(), rate)
        return rate

    def _run(self) -> None:
        drained = _Drained(self.app)
        while True:
            self._wake.wait()
            self._wake.clear()
            while self.held():
                try:
                    self.check()
                except Exception:  # a held chunk's deadline still holds; the gate goes on
                    log.exception("qrq: the fair-share gate met an error (it goes on)")
                time.sleep(CHECK_EVERY_S)
                drained.wait(RECHECK_S)
            drained.close()  # holding nothing: no announcements pile up unread meanwhile


class _Drained:
    """Waits in Redis until a worker announces that it took samples off a shared level
    (`keys.SHARES_DRAINED`); subscribed only while the gate holds chunks. Redis away, it waits
    CHECK_EVERY_S and subscribes again."""

    def __init__(self, app: QrqCelery) -> None:
        self.app = app
        self._sub: redis.client.PubSub | None = None

    def wait(self, seconds: float) -> None:
        try:
            if self._sub is None:
                self._sub = self.app.store.pubsub(ignore_subscribe_messages=True)
                self._sub.psubscribe(keys.SHARES_DRAINED)
            if self._sub.get_message(timeout=seconds) is not None:
                while self._sub.get_message(timeout=0.0) is not None:  # one check for them all
                    pass
        except (redis.RedisError, OSError) as exc:
            log.debug("qrq: fair-share gate: no announcements from Redis (%s)", exc)
            self.close()
            time.sleep(CHECK_EVERY_S)

    def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(redis.RedisError, OSError):
                self._sub.close()
        self._sub = None


_gates = PerApp(Gate)


def gate(app: QrqCelery) -> Gate | None:
    """This process's gate for `app` (None: no gate, every chunk is published at once)."""
    if app.qrq_config.embedded or not app.qrq_config.jobs.fair_shares:
        return None
    return _gates.get(app)


def job_of(app: QrqCelery, job: str | None) -> str:
    """The job a submit runs as: `job`, else $QRQ_JOB, else `[jobs] name`, else `default`
    (ValueError, one line, for a name that cannot be a job's)."""
    name = job or os.environ.get("QRQ_JOB") or app.qrq_config.jobs.name
    if (problem := job_problem(name)) is not None:
        where = "job" if job else "QRQ_JOB" if os.environ.get("QRQ_JOB") else "[jobs] name"
        raise ValueError(f"{where}: {problem}")
    return name

