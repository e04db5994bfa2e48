"""Unit tests of qreward_queue/flushing.py: writes that fall due together share one round trip
per store, in the order they were asked for, and a write that fails is told so."""

from __future__ import annotations

import threading
import time

import fakeredis
import redis

from qreward_queue import flushing

WRITTEN_S = 5.0  # a due write happens within ms; a loaded box may lag


class Store(fakeredis.FakeRedis):
    """A store that counts its round trips (pipelines executed) and can be away."""

    def __init__(self) -> None:
        super().__init__()
        self.trips = 0
        self.away = False

    def pipeline(self, transaction: bool = True, shard_hint: object = None) -> object:
        pipe = super().pipeline(transaction, shard_hint)
        run = pipe.execute

        def execute(raise_on_error: bool = True) -> list:
            self.trips += 1
            if self.away:
                raise redis.ConnectionError("store away")
            return run(raise_on_error)
        pipe.execute = execute  # type: ignore[method-assign]
        return pipe


class Target:
    """Buffers one value for `key`; remembers how its writes went."""

    def __init__(self, store: Store, key: str):
        self.store, self.key = store, key
        self.results: list[bool] = []
        self.done = threading.Event()

    def stage(self, pipe: redis.client.Pipeline) -> flushing.Written:
        pipe.rpush("order", self.key)

        def written(ok: bool) -> None:
            self.results.append(ok)
            self.done.set()
        return written


def test_writes_due_within_a_tick_of_each_other_go_in_one_round_trip():
    store, flusher = Store(), flushing._Flusher()
    first, second, later = Target(store, "a"), Target(store, "b"), Target(store, "c")
    now = time.monotonic()
    # Given two writes due a few ms apart, and one due much later
    flusher.flush_at(first, now + 0.05)
    flusher.flush_at(second, now + 0.05 + flushing.TOGETHER_S / 2)
    flusher.flush_at(later, now + 60)
    # When the first falls due
    assert first.done.wait(WRITTEN_S) and second.done.wait(WRITTEN_S)
    # Then both went in one round trip, in the order asked; the later one waits its time
    assert store.trips == 1 and store.lrange("order", 0, -1) == [b"a", b"b"]
    assert (first.results, second.results, later.results) == ([True], [True], [])
    flusher.flush_all()
    assert later.results == [True] and store.trips == 2


def test_a_write_that_fails_is_told_so_and_each_store_has_its_own_round_trip():
    away, here = Store(), Store()
    away.away = True
    lost, kept = Target(away, "a"), Target(here, "b")
    flushing.write([lost, kept])
    assert (lost.results, kept.results) == ([False], [True])
    assert (away.trips, here.trips) == (1, 1) and here.lrange("order", 0, -1) == [b"b"]


def test_a_target_with_nothing_buffered_costs_no_round_trip():
    class Idle:
        store = Store()

        def stage(self, pipe: object) -> None:
            return None
    idle = Idle()
    flushing.write([idle])
    assert idle.store.trips == 0
