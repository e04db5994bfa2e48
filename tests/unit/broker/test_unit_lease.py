"""Unit tests of batch leases (`qreward_queue/broker/lease.py`) on fakeredis: the client's
side (hold, release, end and the renewer thread) and what a worker's `BatchWatch` makes of a lease.

The renewer runs every third of the key's TTL (a third of a second at the shortest lease), so
its tests wait for it by polling; `BatchWatch` reads a clock the tests move by hand.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import fakeredis
import pytest
import redis
from support import wait_for

from qreward_queue import keys
from qreward_queue.broker import lease

LEASE_S = 3.0  # the key's TTL is then the shortest there is: 1 s
RENEWED_WITHIN_S = 5.0  # the renewer comes round every 1/3 s; a loaded machine may lag


@pytest.fixture
def store() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis(server=fakeredis.FakeServer())


@pytest.fixture
def batches() -> Iterator[list[str]]:
    """Batch ids a test holds; released after it so the renewer forgets them."""
    held: list[str] = []
    yield held
    for batch_id in held:
        lease.release(batch_id)


class Owner:
    """Stands for the RewardBatch that holds a lease."""


def renewed(store: fakeredis.FakeRedis, batch_id: str) -> bool:
    """Shorten the lease's TTL, then wait for the renewer to set it whole again."""
    store.pexpire(keys.lease(batch_id), 300)
    return bool(wait_for(lambda: store.pttl(keys.lease(batch_id)) > 500, RENEWED_WITHIN_S,
                         "the renewer", interval_s=0.02))


def lapses(store: fakeredis.FakeRedis, batch_id: str) -> bool:
    """Shorten the lease's TTL, then wait for it to lapse (no renewal keeps it)."""
    store.pexpire(keys.lease(batch_id), 50)
    # a renewal already under way may set it once more: a second lapses it for good
    return bool(wait_for(lambda: not store.exists(keys.lease(batch_id)), RENEWED_WITHIN_S,
                         "the lease to lapse", interval_s=0.02))


# --------------------------------------------------------------------------------------------
# the client's side: hold, release, end, the renewer


def test_hold_sets_a_live_lease_whose_ttl_leaves_room_to_confirm_a_lapse(store, batches):
    # Given a batch held with a 3 s lease
    owner = Owner()
    batches.append("b-hold")
    # When it is held
    lease.hold(owner, store, "b-hold", LEASE_S)
    # Then its key says live, and lapses within the lease minus the confirmation time
    assert store.get(keys.lease("b-hold")) == lease.LIVE
    assert 0 < store.pttl(keys.lease("b-hold")) <= keys.lease_ttl_ms(LEASE_S)
    assert keys.lease_ttl_ms(LEASE_S) == (LEASE_S - keys.LEASE_CONFIRM_S) * 1000
    assert keys.lease_ttl_ms(0.5) == 1000  # never below a second


def test_hold_does_not_undo_a_cancel(store, batches):
    # Given a batch already cancelled
    store.set(keys.lease("b-cancelled"), lease.CANCELLED)
    batches.append("b-cancelled")
    owner = Owner()
    # When it is held (a late hold, after the cancel)
    lease.hold(owner, store, "b-cancelled", LEASE_S)
    # Then it stays cancelled
    assert store.get(keys.lease("b-cancelled")) == lease.CANCELLED


def test_the_renewer_keeps_a_held_lease_live_until_it_is_released(store, batches):
    # Given a held lease
    owner = Owner()
    batches.append("b-renew")
    lease.hold(owner, store, "b-renew", LEASE_S)
    # When its TTL runs low, Then the renewer sets it whole again
    assert renewed(store, "b-renew")
    assert store.get(keys.lease("b-renew")) == lease.LIVE
    # When it is released, Then nothing keeps it any more: it lapses
    lease.release("b-renew")
    assert lapses(store, "b-renew")


def test_a_lease_nobody_holds_any_more_lapses(store, batches):
    # Given a held lease whose owner is then dropped
    owner = Owner()
    batches.append("b-dropped")
    lease.hold(owner, store, "b-dropped", LEASE_S)
    del owner
    gc.collect()
    # When its TTL runs low, Then the renewer no longer keeps it
    assert lapses(store, "b-dropped")


def test_a_renewal_never_revives_a_cancelled_lease(store, batches):
    # Given two held leases, one of which another process cancels (no release here)
    owner = Owner()
    batches.extend(["b-live", "b-cancel-race"])
    lease.hold(owner, store, "b-live", LEASE_S)
    lease.hold(owner, store, "b-cancel-race", LEASE_S)
    store.set(keys.lease("b-cancel-race"), lease.CANCELLED)
    # When the renewer has come round (it renewed the other one)
    assert renewed(store, "b-live")
    # Then the cancelled one still says so
    assert store.get(keys.lease("b-cancel-race")) == lease.CANCELLED


@pytest.mark.parametrize("state", [lease.CANCELLED, lease.DONE])
def test_end_tells_workers_why_for_keep_s_and_stops_renewing(store, batches, state):
    # Given a held lease
    owner = Owner()
    batches.append("b-end")
    lease.hold(owner, store, "b-end", LEASE_S)
    # When it ends
    lease.end(store, "b-end", state, keep_s=5.0)
    # Then its key says why, for about keep_s, and it is no longer renewed
    assert store.get(keys.lease("b-end")) == state
    assert 3000 < store.pttl(keys.lease("b-end")) <= 5000
    assert lapses(store, "b-end")


# --------------------------------------------------------------------------------------------
# the worker's side: BatchWatch


class Clock:
    """`lease.time` for BatchWatch: monotonic() is moved by the test (sleep stays real for the
    renewer thread, which reads the same module)."""

    sleep = staticmethod(time.sleep)

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(lease, "time", clock)
    return clock


def submitted(store: fakeredis.FakeRedis, batch_id: str, state: bytes | None) -> None:
    """A batch as submit leaves it: its sentinel, and its lease in `state` (None: lapsed)."""
    store.set(keys.batch_sentinel(batch_id), 1)
    if state is not None:
        store.set(keys.lease(batch_id), state)


def test_a_live_lease_lets_calls_go_on(store, clock):
    # Given a batch whose client renews its lease
    submitted(store, "b", lease.LIVE)
    # When a worker looks, Then nothing stops the calls
    assert lease.BatchWatch(store).stop_reason("b") is None
    assert lease.BatchWatch(store).stop_reason(None) is None  # a call of no batch


@pytest.mark.parametrize(("state", "reason"), [
    (lease.CANCELLED, "the batch was cancelled by its caller"),
    (lease.DONE, "the batch already has every outcome"),
])
def test_a_cancelled_or_done_lease_stops_the_calls(store, clock, state, reason):
    # Given a batch whose lease ended so
    submitted(store, "b", state)
    # When a worker looks, Then it is told why to stop
    assert lease.BatchWatch(store).stop_reason("b") == reason


def test_a_lapsed_lease_stops_the_calls_once_seen_lapsed_for_confirm_s(store, clock):
    # Given a batch whose lease lapsed while its data is still there (its client died)
    submitted(store, "b", None)
    watch = lease.BatchWatch(store)
    # When a worker first sees it lapsed, and again a little later, Then the calls go on
    assert watch.stop_reason("b") is None
    clock.now += keys.LEASE_CONFIRM_S / 2
    assert watch.stop_reason("b") is None
    # When it is still lapsed LEASE_CONFIRM_S after it was first seen so, Then they stop
    clock.now += keys.LEASE_CONFIRM_S / 2
    assert watch.stop_reason("b") == "the caller's lease lapsed (its client stopped renewing it)"


def test_a_lease_set_again_after_a_short_lapse_stops_nothing(store, clock):
    # Given a lease seen lapsed (a Redis outage let it expire), then set again by its client
    submitted(store, "b", None)
    watch = lease.BatchWatch(store)
    assert watch.stop_reason("b") is None
    clock.now += keys.LEASE_CONFIRM_S / 2
    store.set(keys.lease("b"), lease.LIVE)
    assert watch.stop_reason("b") is None
    # When it lapses again, Then its confirmation time starts over
    store.delete(keys.lease("b"))
    clock.now += keys.LEASE_CONFIRM_S / 2
    assert watch.stop_reason("b") is None
    clock.now += keys.LEASE_CONFIRM_S / 2
    assert watch.stop_reason("b") is None
    clock.now += keys.LEASE_CONFIRM_S / 2
    assert watch.stop_reason("b") is not None


def test_a_missing_lease_without_its_batch_data_stops_nothing(store, clock):
    # Given a batch whose lease and sentinel are both gone (Redis lost its data)
    watch = lease.BatchWatch(store)
    # When a worker looks for longer than LEASE_CONFIRM_S, Then the calls go on
    assert watch.stop_reason("b") is None
    clock.now += 2 * keys.LEASE_CONFIRM_S
    assert watch.stop_reason("b") is None


def test_a_look_is_reused_for_check_every_s(store, clock):
    # Given a live lease a worker has just looked at
    submitted(store, "b", lease.LIVE)
    watch = lease.BatchWatch(store)
    assert watch.stop_reason("b") is None
    # When the batch is cancelled, Then a look within CHECK_EVERY_S still says go on
    store.set(keys.lease("b"), lease.CANCELLED)
    clock.now += lease.CHECK_EVERY_S / 2
    assert watch.stop_reason("b") is None
    # And the next look after it sees the cancel
    clock.now += lease.CHECK_EVERY_S / 2
    assert watch.stop_reason("b") == "the batch was cancelled by its caller"


def test_with_redis_away_the_last_answer_stands(clock):
    # Given a worker that saw one batch cancelled and another live
    server = fakeredis.FakeServer()
    store = fakeredis.FakeRedis(server=server)
    submitted(store, "gone", lease.CANCELLED)
    submitted(store, "on", lease.LIVE)
    watch = lease.BatchWatch(store)
    assert watch.stop_reason("gone") is not None
    assert watch.stop_reason("on") is None
    # When the leases change (the first is set again, the other cancelled), but Redis is
    # unreachable by the time the worker looks again
    store.set(keys.lease("gone"), lease.LIVE)
    store.set(keys.lease("on"), lease.CANCELLED)
    server.connected = False
    with pytest.raises(redis.ConnectionError):
        store.get(keys.lease("on"))
    clock.now += 2 * keys.LEASE_CONFIRM_S
    # Then each keeps its last answer (no stop made up, none forgotten)
    assert watch.stop_reason("gone") == "the batch was cancelled by its caller"
    assert watch.stop_reason("on") is None
