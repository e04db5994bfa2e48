"""Unit tests of the spend ledger (`qreward_queue/flow/spend.py`) on fakeredis, which runs the
same booking Lua: bookings under a `[budget]`, their reconciliation with the real usage, cost
from a `[price]`, and what a flush writes (backend total and hour, batch, job).

The hour is pinned by hand where a test crosses one; flushes are called directly except in the
test of the flushing thread. End to end (real workers, a mock judge's own counters):
tests/e2e/test_spend.py.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import fakeredis
import pytest
from support import backend_of, wait_for

from qreward_queue import keys
from qreward_queue.config.model import Backend, Budget, Price
from qreward_queue.errors import BudgetExceeded
from qreward_queue.flow import spend
from qreward_queue.flow.spend import Booking, Ledger, Usage, backend_spend, batch_spend
from qreward_queue.message import DEFAULT_JOB
from qreward_queue.ops import job_spend

HOUR = 493_000  # UTC hours since the epoch, pinned
PRICE = Price(input_per_million=2.0, output_per_million=8.0)
JUDGE = backend_of("judge", name="judge-l", url="http://judge.invalid/v1", model="m")
FLUSHED_WITHIN_S = 5.0  # the flushing thread writes within FLUSH_EVERY_S; a loaded box may lag


@pytest.fixture
def server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


@pytest.fixture
def store(server: fakeredis.FakeServer) -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis(server=server)


@pytest.fixture
def hour(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The current UTC hour as the ledger sees it; a test moves it by setting hour[0]."""
    now = [HOUR]
    for module in (spend, job_spend):
        monkeypatch.setattr(module, "hour_now", lambda: now[0])
    return now


def capped(price: Price | None = None, **caps: float) -> Backend:
    return replace(JUDGE, budget=Budget(**caps), price=price)


def fields(store: fakeredis.FakeRedis, key: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in store.hgetall(key).items()}


def held(store: fakeredis.FakeRedis, at: int = HOUR) -> tuple[int, int]:
    got = fields(store, keys.spend(JUDGE.name, at))
    return got.get("held_tokens", 0), got.get("held_cost_micro", 0)


# --------------------------------------------------------------------------------------------
# booking under a budget


def test_a_booking_under_the_cap_is_held_in_the_hours_hash(store, hour):
    # Given a backend capped at 100 tokens in all
    ledger = Ledger(store, capped(tokens_total=100))
    assert ledger.has_budget
    # When a call books its bound of 30 in and 10 out
    booking = ledger.book(Usage.estimate(30, 10))
    # Then the booking is held in this hour's hash and counts as used against the cap
    assert booking == Booking(HOUR, 40, 0)
    assert held(store) == (40, 0)
    assert 0 < store.ttl(keys.spend(JUDGE.name, HOUR)) <= spend.HOUR_KEEP_S
    assert backend_spend(store, ledger.backend)["budgets"] == {
        "tokens_total": {"limit": 100, "used": 40, "left": 60}}


def test_bookings_may_reach_a_cap_and_the_one_past_it_is_refused_naming_it(store, hour):
    # Given a backend capped at 100 tokens in all, with 60 booked
    ledger = Ledger(store, capped(tokens_total=100))
    ledger.book(Usage.estimate(50, 10))
    # When a call books exactly what is left, then another one token more
    ledger.book(Usage.estimate(40, 0))
    with pytest.raises(BudgetExceeded) as refused:
        ledger.book(Usage.estimate(1, 0))
    # Then the first is booked, the second refused naming the cap, what is used and needed,
    # and the refusal holds nothing
    assert refused.value.cap == "tokens_total"
    assert str(refused.value) == ("budget tokens_total = 100 of backend 'judge-l' reached "
                                  "(100 used, the call needs ~1): the call was not made")
    assert held(store) == (100, 0)


@pytest.mark.parametrize("cap", ["cost_total", "cost_per_hour"])
def test_a_cost_cap_books_the_price_of_the_bound_in_micro_units(store, hour, cap):
    # Given a priced backend capped at 0.0157 (its price unit), which is 15,700 micro units
    ledger = Ledger(store, capped(PRICE, **{cap: 0.0157}))
    # When a call bounded at 3,000 tokens in and 1,000 out books (6,000 + 8,000 = 14,000 µ)
    assert ledger.book(Usage.estimate(3000, 1000)) == Booking(HOUR, 4000, 14_000)
    # and one of exactly the 1,700 µ left (850 tokens in), then one of 2 µ more
    assert ledger.book(Usage.estimate(850, 0)) == Booking(HOUR, 850, 1700)
    with pytest.raises(BudgetExceeded) as refused:
        ledger.book(Usage.estimate(1, 0))
    # Then both fit and the third is refused, its figures in the price's unit
    assert refused.value.cap == cap
    assert f"budget {cap} = 0.0157 of backend 'judge-l' reached (0.0157 used, the call " \
           f"needs ~2e-06)" in str(refused.value)
    assert held(store) == (4850, 15_700)
    assert backend_spend(store, ledger.backend)["budgets"][cap] == {
        "limit": 0.0157, "used": 0.0157, "left": 0.0}


def test_a_per_hour_cap_counts_this_hour_and_a_total_cap_every_hour(store, hour):
    # Given 80 tokens spent last hour on a backend with both kinds of cap
    ledger = Ledger(store, capped(tokens_per_hour=100, tokens_total=150))
    hour[0] = HOUR - 1
    ledger.spent(Usage(60, 20), None, None)
    ledger.flush()
    hour[0] = HOUR
    # When a call books 60 this hour, then one 20 more
    ledger.book(Usage.estimate(60, 0))
    # Then the hour's cap had room for the first (last hour does not count against it), and
    # the total cap refuses the second: 80 spent + 60 held + 20 > 150
    with pytest.raises(BudgetExceeded, match=r"tokens_total = 150 .* \(140 used"):
        ledger.book(Usage.estimate(20, 0))
    budgets = backend_spend(store, ledger.backend)["budgets"]
    assert budgets == {"tokens_per_hour": {"limit": 100, "used": 60, "left": 40},
                       "tokens_total": {"limit": 150, "used": 140, "left": 10}}


def test_concurrent_bookings_never_pass_the_cap(store, hour):
    # Given a cap of 100 tokens and 24 threads each booking 10 at the same moment
    ledger = Ledger(store, capped(tokens_total=100))
    start, booked, refused = threading.Barrier(24), [], []

    def book() -> None:
        start.wait()
        try:
            booked.append(ledger.book(Usage.estimate(10, 0)))
        except BudgetExceeded:
            refused.append(1)

    threads = [threading.Thread(target=book) for _ in range(24)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Then exactly ten are booked (each booking checks and holds in one step)
    assert (len(booked), len(refused)) == (10, 14)
    assert held(store) == (100, 0)


def test_without_a_budget_nothing_is_booked(store, hour):
    # Given a backend with no [budget]
    ledger = Ledger(store, JUDGE)
    # When a call would book its bound
    # Then the ledger says so and holds nothing
    assert not ledger.has_budget
    assert ledger.book(Usage.estimate(10**9, 10**9)) is None
    assert store.keys("*") == []


# --------------------------------------------------------------------------------------------
# the bound a call books


def test_the_bound_is_a_token_a_byte_until_replies_show_fewer_then_the_most_seen_plus_margin():
    # Given a ledger no reply has taught yet
    ledger = Ledger(fakeredis.FakeRedis(), JUDGE)
    # Then a call's input is bounded at one token a byte, its output at all it may write
    assert ledger.bound(1000, 16) == Usage(1000, 16, estimated=True)
    # When replies show 0.25 then 0.1 tokens a byte
    ledger.observe(400, 100)
    ledger.observe(1000, 100)
    # Then the bound is the most seen with its 25% margin (rounded up); unlearned on demand
    assert ledger.bound(1000, 16) == Usage(313, 16, estimated=True)
    assert ledger.bound(1000, 16, learned=False) == Usage(1000, 16, estimated=True)
    # and never above a token a byte, whatever a reply says
    ledger.observe(10, 50)
    assert ledger.bound(1000, 0) == Usage(1000, 0, estimated=True)


# --------------------------------------------------------------------------------------------
# cost


@pytest.mark.parametrize(("usage", "price", "micro"), [
    (Usage(1234, 56), PRICE, 1234 * 2 + 56 * 8),
    (Usage(3, 1), Price(input_per_million=0.25, output_per_million=0.5), 1),  # 1.25 rounds
    (Usage(1234, 56), None, 0),
], ids=["priced", "rounded", "no price"])
def test_cost_is_tokens_times_the_price_per_million_in_micro_units(usage, price, micro):
    assert usage.cost_micro(replace(JUDGE, price=price)) == micro


# --------------------------------------------------------------------------------------------
# what a flush writes


def test_a_flush_adds_each_call_to_the_total_the_hour_and_the_batch(store, hour):
    # Given a priced backend's calls: two of batch b1, one estimated, and one of no batch
    ledger = Ledger(store, replace(JUDGE, price=PRICE))
    ledger.spent(Usage(100, 10), None, "b1")
    ledger.spent(Usage.estimate(50, 5), None, "b1")
    ledger.spent(Usage(7, 1), None, None)
    # When they are flushed
    ledger.flush()
    # Then the running total and the hour's hash hold all three, the hour's kept 2 h
    cost = (157 * 2 + 16 * 8)
    want = {"calls": 3, "tokens_in": 157, "tokens_out": 16, "estimated": 1, "cost_micro": cost}
    assert fields(store, keys.spend(JUDGE.name)) == want
    assert fields(store, keys.spend(JUDGE.name, HOUR)) == want
    assert store.ttl(keys.spend(JUDGE.name)) == -1
    assert 0 < store.ttl(keys.spend(JUDGE.name, HOUR)) <= spend.HOUR_KEEP_S
    # and the batch's tally holds its two calls, as summary() shows them
    assert batch_spend(store, "b1") == {JUDGE.name: {
        "calls": 2, "tokens_in": 150, "tokens_out": 15, "estimated_calls": 1,
        "cost": (150 * 2 + 15 * 8) / 1e6}}
    assert 0 < store.ttl(keys.batch_spend("b1")) <= spend.BATCH_KEEP_S
    assert backend_spend(store, ledger.backend)["total"] == {
        "calls": 3, "tokens_in": 157, "tokens_out": 16, "estimated_calls": 1,
        "cost": cost / 1e6}
    # and a second flush with nothing new writes nothing more
    ledger.flush()
    assert fields(store, keys.spend(JUDGE.name))["calls"] == 3


def test_a_batchs_share_is_written_alone_and_never_twice(store, hour):
    # Given calls of batches b1 and b2
    ledger = Ledger(store, JUDGE)
    ledger.spent(Usage(100, 10), None, "b1")
    ledger.spent(Usage(40, 4), None, "b2")
    # When b1's share is written (what its recorder does before announcing its outcomes)
    with store.pipeline(transaction=False) as pipe:
        written = ledger.stage_batch("b1", pipe)
        pipe.execute()
    assert written is not None
    written(True)
    # Then b1's tally is there, b2's and the backend's totals wait for the next flush
    assert batch_spend(store, "b1")[JUDGE.name]["calls"] == 1
    assert batch_spend(store, "b2") == {}
    assert fields(store, keys.spend(JUDGE.name)) == {}
    # and that flush writes the rest, b1's share not a second time
    ledger.flush()
    assert batch_spend(store, "b1")[JUDGE.name]["tokens_in"] == 100
    assert batch_spend(store, "b2")[JUDGE.name]["tokens_in"] == 40
    assert fields(store, keys.spend(JUDGE.name))["calls"] == 2


def test_a_batchs_share_that_could_not_be_written_goes_with_the_next_write(store, hour):
    # Given a batch's share staged for a round trip that never ran (Redis away)
    ledger = Ledger(store, JUDGE)
    ledger.spent(Usage(100, 10), None, "b1")
    with store.pipeline(transaction=False) as pipe:
        written = ledger.stage_batch("b1", pipe)
    assert written is not None
    written(False)
    # When the ledger next writes
    ledger.flush()
    # Then the share is there, once
    assert batch_spend(store, "b1")[JUDGE.name]["calls"] == 1
    assert fields(store, keys.spend(JUDGE.name))["calls"] == 1


def test_each_jobs_spend_is_its_own(store, hour):
    # Given calls of two jobs and one that names none
    ledger = Ledger(store, replace(JUDGE, price=PRICE))
    ledger.spent(Usage(100, 10), None, "b1", job="alice")
    ledger.spent(Usage(30, 3), None, "b2", job="bob")
    ledger.spent(Usage(1, 1), None, "b3")
    # When they are flushed
    ledger.flush()
    # Then each job's total and hour hold its own calls, and the jobs are listed
    assert fields(store, keys.job_spend("alice")) == fields(
        store, keys.job_spend("alice", HOUR)) == {
        "calls": 1, "tokens_in": 100, "tokens_out": 10, "cost_micro": 280}
    assert 0 < store.ttl(keys.job_spend("alice", HOUR)) <= spend.HOUR_KEEP_S
    assert store.smembers(keys.JOBS) == {b"alice", b"bob", DEFAULT_JOB.encode()}
    assert job_spend.job_use(store, ["bob"]) == {"bob": {
        "tokens_total": 33, "tokens_per_hour": 33, "cost_total": 84e-6,
        "cost_per_hour": 84e-6}}


# --------------------------------------------------------------------------------------------
# reconciling a booking with the real usage


def test_the_real_usage_replaces_the_booking(store, hour):
    # Given a priced backend capped at 100 tokens, a call that booked 90 (bound 80 in, 10 out)
    ledger = Ledger(store, capped(PRICE, tokens_total=100))
    booking = ledger.book(Usage.estimate(80, 10))
    with pytest.raises(BudgetExceeded):
        ledger.book(Usage.estimate(20, 0))
    # When its reply says it used 12 in and 3 out
    ledger.spent(Usage(12, 3), booking, "b1")
    ledger.flush()
    # Then the booking is given back, the real usage is counted in its place
    assert held(store) == (0, 0)
    assert fields(store, keys.spend(JUDGE.name, HOUR)) == {
        "calls": 1, "tokens_in": 12, "tokens_out": 3, "cost_micro": 48,
        "held_tokens": 0, "held_cost_micro": 0}
    assert backend_spend(store, ledger.backend)["budgets"]["tokens_total"] == {
        "limit": 100, "used": 15, "left": 85}
    # and the room it freed takes a booking the hold refused
    assert ledger.book(Usage.estimate(85, 0)) == Booking(HOUR, 85, 170)


def test_a_booking_is_given_back_to_the_hour_it_was_held_in(store, hour):
    # Given a call that booked in one hour and was answered in the next
    ledger = Ledger(store, capped(tokens_per_hour=1000))
    booking = ledger.book(Usage.estimate(40, 10))
    hour[0] = HOUR + 1
    # When its usage is flushed
    ledger.spent(Usage(20, 5), booking, None)
    ledger.flush()
    # Then the old hour's hold is released and the usage counts in the new hour
    assert held(store, HOUR) == (0, 0)
    assert held(store, HOUR + 1) == (0, 0)
    assert fields(store, keys.spend(JUDGE.name, HOUR + 1))["tokens_in"] == 20
    assert "tokens_in" not in fields(store, keys.spend(JUDGE.name, HOUR))


# --------------------------------------------------------------------------------------------
# when the writes happen


def test_the_flushing_thread_writes_the_spend_without_being_asked(store, hour):
    # Given a call's usage added and a booking to give back, no flush called
    ledger = Ledger(store, capped(tokens_total=1000))
    booking = ledger.book(Usage.estimate(50, 10))
    ledger.spent(Usage(20, 4), booking, "b1")
    # Then the flushing thread writes both soon after (within FLUSH_EVERY_S; the hold's
    # release is the flush's last write)
    wait_for(lambda: held(store) == (0, 0), FLUSHED_WITHIN_S, "the flush", interval_s=0.01)
    assert fields(store, keys.spend(JUDGE.name)) == {"calls": 1, "tokens_in": 20,
                                                     "tokens_out": 4}
    assert held(store) == (0, 0)


def test_spend_is_kept_when_redis_is_away_and_written_by_the_next_flush(
    store, server, hour, monkeypatch
):
    # Given a call's usage and its booking to give back, flushed only when the test says
    monkeypatch.setattr(spend.flushing, "flush_at", lambda target, when: None)
    ledger = Ledger(store, capped(tokens_total=1000))
    booking = ledger.book(Usage.estimate(50, 10))
    ledger.spent(Usage(20, 4), booking, "b1")
    # When a flush finds Redis away, then one finds it back
    server.connected = False
    ledger.flush()
    server.connected = True
    assert held(store) == (60, 0)
    ledger.flush()
    # Then nothing was lost and nothing counted twice
    assert fields(store, keys.spend(JUDGE.name)) == {"calls": 1, "tokens_in": 20,
                                                     "tokens_out": 4}
    assert held(store) == (0, 0)
    assert batch_spend(store, "b1")[JUDGE.name]["calls"] == 1
