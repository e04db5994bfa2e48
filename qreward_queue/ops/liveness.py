"""Which backend queues a live worker consumes, so that a batch published to a queue nobody
serves is said out loud within seconds instead of waiting silently for its deadline.

Each worker's heartbeat keeps `qrq:alive:<node>` fresh (15 s TTL) and adds the node to a set
`qrq:consumers:<queue>` per queue it consumes; a node in that set whose heartbeat key lapsed
is dead and is dropped from the set by whoever reads it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import redis

from .. import flushing, keys
from ..background import Daemon

log = logging.getLogger("qreward_queue")


def beat(store: redis.Redis, node: str, queues: Iterable[str], ttl_s: float,
         pools: dict[str, dict] | None = None) -> None:
    """One heartbeat of worker `node` consuming `queues`, with the size of its call `pools`
    (one round trip)."""
    with store.pipeline(transaction=False) as pipe:
        pipe.set(keys.alive(node), 1, ex=int(ttl_s))
        if pools:
            pipe.set(keys.call_pools(node), json.dumps(pools), ex=int(ttl_s))
        for queue in queues:
            pipe.sadd(keys.consumers(queue), node)
            pipe.expire(keys.consumers(queue), keys.CONSUMERS_TTL_S)
        pipe.execute()


def call_pools(store: redis.Redis, nodes: list[str], backend: str) -> dict[str, dict]:
    """Each live node's calls in flight to `backend` and why, as its last heartbeat said."""
    said = store.mget([keys.call_pools(n) for n in nodes]) if nodes else []
    pools = {n: json.loads(s) for n, s in zip(nodes, said, strict=True) if s}
    return {n: p[backend] for n, p in pools.items() if backend in p}


def live_workers(store: redis.Redis, queue: str) -> list[str]:
    """Nodes with a fresh heartbeat that consume `queue` (dead ones are forgotten)."""
    # redis-py types replies bytes | str; a client without decode_responses gets bytes
    nodes = sorted(n.decode() for n in store.smembers(keys.consumers(queue)))  # type: ignore[union-attr]
    if not nodes:
        return []
    alive = store.mget([keys.alive(n) for n in nodes])
    dead = [n for n, a in zip(nodes, alive, strict=True) if not a]
    if dead:
        store.srem(keys.consumers(queue), *dead)
    return [n for n, a in zip(nodes, alive, strict=True) if a]


class NoWorkerWatch:
    """Warns once per backend when a batch waits on a queue that no live worker consumes.

    The client's watchdog calls `check` at each of its looks (every few seconds, never while
    Redis's view of the workers is stale after an outage); it warns after two looks in a row
    found nobody (so a worker that is just starting is not reported). The batch keeps
    waiting: a worker may still come.
    """

    def __init__(self, app) -> None:
        self.app = app
        self.warned: set[str] = set()
        self._unserved: set[str] = set()

    def forget(self) -> None:
        """Redis was unreachable: what the last look saw no longer counts."""
        self._unserved = set()

    def check(self, backends: Iterable[str]) -> None:
        config = self.app.qrq_config
        if config.embedded:
            return
        unserved = set()
        with contextlib.suppress(redis.RedisError):  # Redis restarting: look again later
            unserved = {
                b
                for b in set(backends) - self.warned
                if not live_workers(self.app.store, config.backend(b).queue)
            }
        for name in sorted(unserved & self._unserved):
            log.warning("qrq: warning: %s (still waiting, until the batch deadline)",
                        self.cause(name))
            self.warned.add(name)
        self._unserved = unserved - self.warned

    def cause(self, name: str) -> str:
        """What is wrong with backend `name`'s queue, and the command that fixes it."""
        backend = self.app.qrq_config.backend(name)
        return (f"no live worker consumes queue {backend.queue} of backend {name!r}; start one "
                f"with `qrq worker {backend.source}`")


class HeldKeeper:
    """Says again, every `every_s`, which tasks this process is running (`qrq:held:<task>` =
    its node), so that after Redis lost its data a client can tell a task still running,
    which it must not send again (that would buy its calls twice), from one that was lost.

    A task's key is set when the worker receives it and deleted when it ended for good (not
    one that retries itself: its message waits in this worker for its countdown); both are
    written by the process's flusher with the other writes then due, in the order they came,
    so neither the consumer nor a task waits on a round trip for them. A delete that Redis
    refused is tried again every `every_s` until Redis answers: a task that gave up on Redis
    is then seen lost by its client and sent again, rather than waiting out the broker's
    visibility timeout."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._lock = threading.Lock()
        self._running: dict[str, tuple[redis.Redis, str, int]] = {}
        self._ended: dict[str, redis.Redis] = {}  # tasks whose key is still to be deleted
        self._writes: dict[int, _HeldWrites] = {}  # per store
        self._thread = Daemon("qrq-held", self._run)

    def received(self, store: redis.Redis, task_id: str, node: str, ttl_s: int) -> None:
        """`task_id` is held by `node` from now (it may wait for a slot or a countdown)."""
        self._writes_to(store).put(task_id, (node, ttl_s))

    @contextlib.contextmanager
    def holding(self, store: redis.Redis, task_id: str, node: str, ttl_s: int,
                keeps: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
        """Hold `task_id` while the block runs; its key stays after the block only when the
        block raised one of `keeps` (the task goes on later)."""
        with self._lock:
            self._running[task_id] = (store, node, ttl_s)
            self._thread.ensure()
        ended = True
        try:
            yield
        except keeps:
            ended = False
            raise
        finally:
            with self._lock:
                self._running.pop(task_id, None)
            if ended:
                self._writes_to(store).put(task_id, None)

    def _writes_to(self, store: redis.Redis) -> _HeldWrites:
        with self._lock:
            writes = self._writes.get(id(store))
            if writes is None:
                writes = self._writes[id(store)] = _HeldWrites(store, self._refused)
            return writes

    def _refused(self, ended: dict[str, redis.Redis]) -> None:
        """Deletes Redis refused: the keeper's next round tries them again."""
        with self._lock:
            self._ended.update(ended)
            self._thread.ensure()

    def _run(self) -> None:
        while True:
            time.sleep(self.every_s)
            with self._lock:
                running = list(self._running.items())
                ended, self._ended = self._ended, {}
            for task_id, store in ended.items():  # refused before: tried again
                self._writes_to(store).put(task_id, None)
            if not running:
                continue
            store = running[0][1][0]
            # Redis away: say it again at the next round
            with contextlib.suppress(redis.RedisError, OSError), store.pipeline(False) as pipe:
                for task_id, (_, node, ttl_s) in running:
                    pipe.set(keys.held(task_id), node, ex=ttl_s)
                pipe.execute()


class _HeldWrites:
    """Held keys of one store to set (task id -> node and TTL) or delete (-> None), in the
    order they came, for the flusher (a `flushing.Flushable`)."""

    def __init__(self, store: redis.Redis, refused: Callable[[dict[str, redis.Redis]], None]):
        self.store, self._refused = store, refused
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[str, int] | None] = {}

    def put(self, task_id: str, held: tuple[str, int] | None) -> None:
        with self._lock:
            self._pending[task_id] = held  # a delete after a set not yet written: only it
        flushing.flush_at(self, time.monotonic())

    def stage(self, pipe: Any) -> flushing.Written | None:
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return None
        for task_id, held in pending.items():
            if held is None:
                pipe.delete(keys.held(task_id))
            else:
                pipe.set(keys.held(task_id), held[0], ex=held[1])

        def written(ok: bool) -> None:
            if ok:
                return
            deletes = {t: self.store for t, held in pending.items() if held is None}
            if deletes:  # a lost set is said again while its task runs
                self._refused(deletes)
        return written
