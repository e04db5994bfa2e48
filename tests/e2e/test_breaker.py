"""Unit tests (fakeredis): the circuit breaker's state machine and the route planner.

The breaker keeps its state in expiring Redis keys, so fakeredis (which expires keys on the
wall clock) runs the real code; the cooldowns here are tens of milliseconds. The planner's
pure functions (`water_fill`, `spread`, `plan`) need no store at all; `route_shares` runs on
an embedded app, whose store is fakeredis.
"""

from __future__ import annotations

import threading
import time

import fakeredis
import pytest
from support import wait_for

from qreward_queue.backends import Call, FunctionOptions
from qreward_queue.broker.app import QrqCelery
from qreward_queue.config.model import Backend, Config, Limits, Pool, Retry, Route
from qreward_queue.errors import RateLimited
from qreward_queue.flow.breaker import CircuitBreaker
from qreward_queue.flow.ratelimit_headers import Feedback
from qreward_queue.planning.capacity import route_shares
from qreward_queue.planning.routing import Chunk, plan, spread, water_fill
from qreward_queue.worker import call_path
from qreward_queue.worker.chunk_runner import ChunkRunner

COOLDOWN_S = 0.5  # long enough that a loaded machine does not see it lapse mid-check


@pytest.fixture
def store():
    return fakeredis.FakeRedis(server=fakeredis.FakeServer())


def make_breaker(store, threshold=3, cooldown_s=COOLDOWN_S, name="judge-a") -> CircuitBreaker:
    return CircuitBreaker(store, name, threshold=threshold, cooldown_s=cooldown_s)


def trip(breaker: CircuitBreaker) -> None:
    for _ in range(breaker.threshold):
        breaker.failure()
    assert breaker.is_open()


def wait_out_cooldown(breaker: CircuitBreaker) -> None:
    wait_for(lambda: not breaker.is_open(), 5, "the open key to expire", interval_s=0.01)


# --------------------------------------------------------------------------------------------
# Circuit breaker


def test_closed_breaker_opens_after_threshold_consecutive_failures(store):
    breaker = make_breaker(store, threshold=3)
    assert breaker.allow() and not breaker.is_open()
    breaker.failure()
    breaker.failure()
    # two failures of three: still closed, every caller passes
    assert not breaker.is_open()
    assert all(breaker.allow() for _ in range(5))
    breaker.failure()
    # the third in a row opens it: nobody passes
    assert breaker.is_open()
    assert not any(breaker.allow() for _ in range(5))


def test_success_resets_the_failure_count(store):
    breaker = make_breaker(store, threshold=3)
    for _ in range(5):  # never three in a row: two failures, then a success
        breaker.failure()
        breaker.failure()
        breaker.success()
    assert not breaker.is_open()
    assert breaker.allow()
    # and counting starts again from zero after the last success
    breaker.failure()
    breaker.failure()
    assert not breaker.is_open()
    breaker.failure()
    assert breaker.is_open()


def test_breakers_are_per_backend_and_shared_through_the_store(store):
    a_here, a_there = make_breaker(store, name="a"), make_breaker(store, name="a")
    b = make_breaker(store, name="b")
    a_here.failure()
    a_there.failure()  # another process, same backend: the count is shared
    a_here.failure()
    assert a_there.is_open() and not a_there.allow()
    assert not b.is_open() and b.allow()


def test_open_breaker_allows_nobody_until_the_cooldown_ends(store):
    breaker = make_breaker(store, cooldown_s=1.0)
    trip(breaker)
    started = time.monotonic()
    while time.monotonic() - started < 0.3:
        assert not breaker.allow()
        time.sleep(0.02)
    assert breaker.is_open()


def test_after_cooldown_exactly_one_probe_among_many_callers(store):
    breaker = make_breaker(store)
    trip(breaker)
    wait_out_cooldown(breaker)
    callers = [make_breaker(store) for _ in range(32)]  # 32 "processes" sharing the store
    barrier = threading.Barrier(len(callers))
    answers: list[bool] = []
    lock = threading.Lock()

    def call(b: CircuitBreaker) -> None:
        barrier.wait()
        allowed = b.allow()
        with lock:
            answers.append(allowed)

    threads = [threading.Thread(target=call, args=(b,)) for b in callers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(answers) == len(callers)
    assert answers.count(True) == 1, answers
    # and while the probe is out, later callers still wait
    assert not any(breaker.allow() for _ in range(10))


def test_probe_success_closes_the_breaker(store):
    breaker = make_breaker(store)
    trip(breaker)
    wait_out_cooldown(breaker)
    assert breaker.allow()  # the probe
    breaker.success()
    assert not breaker.is_open()
    assert all(breaker.allow() for _ in range(10))  # closed: everyone passes again
    # and it is really closed: it takes a full threshold of failures to open it again
    breaker.failure()
    breaker.failure()
    assert not breaker.is_open()


def test_probe_failure_reopens_the_breaker_at_once(store):
    breaker = make_breaker(store, threshold=3)
    trip(breaker)
    wait_out_cooldown(breaker)
    assert breaker.allow()  # the probe
    breaker.failure()  # one failure, below the threshold, is enough while half-open
    assert breaker.is_open()
    assert not breaker.allow()
    # a new cooldown, then a new single probe
    wait_out_cooldown(breaker)
    assert breaker.allow()
    assert not breaker.allow()


class ScriptedClient:
    """A backend client answering from a script: an exception to raise or a score."""

    samples_per_call = 1
    runs_locally = False

    def __init__(self, *answers):
        self.answers, self.calls = list(answers), 0

    def split(self, samples):
        return [[i] for i in range(len(samples))]

    def estimate_tokens(self, samples):
        return 1.0

    def call(self, samples):
        self.calls += 1
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return Call([answer], status_code=200, headers={}, details=["scripted"])

    def feedback(self, result):
        return Feedback.from_http(result.status_code, result.headers)


def test_probe_answered_429_does_not_shut_the_backend(store, monkeypatch):
    # Given a tripped breaker whose cooldown is over, and a backend that answers the probe
    # with 429 and the next call with a score
    breaker = make_breaker(store)
    trip(breaker)
    wait_out_cooldown(breaker)
    client = ScriptedClient(RateLimited("rate limited (429)", status_code=429), 0.5)
    config = Backend(name="judge-a", kind="function", options=FunctionOptions(function="m:f"))
    monkeypatch.setattr(call_path, "make_backend", lambda _config: client)
    # When a worker runs one sample through it
    result = ChunkRunner(config, None, breaker, attempt=1).run([{"prompt": "p",
                                                                      "response": "r"}])
    # Then the 429 is waited out and the call made again (as for any 429), not refused
    assert client.calls == 2
    assert result.outcomes[0].status == "ok", result.outcomes[0]
    assert not breaker.is_open() and breaker.allow()


# --------------------------------------------------------------------------------------------
# water_fill: how many of n new samples each backend gets


def test_water_fill_splits_in_proportion_to_rates_when_queues_are_empty():
    assert water_fill(60, [10, 20, 30], [0, 0, 0]) == [10.0, 20.0, 30.0]
    shares = water_fill(300, [600, 1200, 1800], [0, 0, 0])
    assert shares == pytest.approx([50, 100, 150])


def test_water_fill_accounts_for_queued_backlog():
    # a backend with a queue gets less, so both finish at the same time
    shares = water_fill(30, [10, 10], [10, 0])
    assert shares == pytest.approx([10, 20])
    assert (10 + shares[0]) / 10 == pytest.approx((0 + shares[1]) / 10)
    # a backend whose backlog outlasts the whole batch gets nothing at all
    assert water_fill(10, [10, 10], [20, 0]) == [0.0, 10.0]


def test_water_fill_gives_nothing_to_a_backend_without_rate():
    shares = water_fill(100, [0, 50, 50], [0, 0, 0])
    assert shares == pytest.approx([0, 50, 50])
    assert sum(water_fill(7, [3, 0, 1], [0, 0, 4])) == pytest.approx(7)


def test_water_fill_always_hands_out_exactly_n():
    for n, rates, queued in [
        (1, [1, 2, 3], [0, 5, 0]),
        (1000, [7, 11, 13], [100, 0, 50]),
        (5, [10, 10, 10], [0, 30, 60]),
    ]:
        shares = water_fill(n, rates, queued)
        assert sum(shares) == pytest.approx(n)
        assert all(s >= 0 for s in shares)


# --------------------------------------------------------------------------------------------
# spread and plan


def three_way_route(weights=(1.0, 2.0, 3.0)) -> Route:
    return Route(name="r", backends=("a", "b", "c"), weights=weights)


def test_spread_follows_weights_within_one_sample():
    dealt = spread(list(range(600)), three_way_route())
    counts = [len(dealt[n]) for n in ("a", "b", "c")]
    for got, want in zip(counts, (100, 200, 300), strict=True):
        assert abs(got - want) <= 1, counts
    # every index dealt exactly once
    assert sorted(i for v in dealt.values() for i in v) == list(range(600))


def test_spread_follows_explicit_shares_and_interleaves():
    dealt = spread(list(range(600)), three_way_route(), shares=[0.0, 100.0, 500.0])
    assert dealt["a"] == []
    assert abs(len(dealt["b"]) - 100) <= 1 and abs(len(dealt["c"]) - 500) <= 1
    # smooth weighted round robin: every backend's part is spread through the batch
    assert dealt["b"][0] < 10 and dealt["b"][-1] > 590


def test_spread_with_all_zero_shares_falls_back_to_equal_parts():
    dealt = spread(list(range(300)), three_way_route(), shares=[0.0, 0.0, 0.0])
    assert [len(dealt[n]) for n in ("a", "b", "c")] == [100, 100, 100]


def config_with_chunks(sizes: dict[str, int]) -> Config:
    backends = {
        name: Backend(name=name, kind="function", chunk_size=size,
                      options=FunctionOptions(function="m:f"))
        for name, size in sizes.items()
    }
    return Config(redis_url=None, backends=backends, routes={})


def test_plan_chunks_by_backend_chunk_size_and_interleaves_backends():
    config = config_with_chunks({"a": 4, "b": 10})
    route = Route(name="r", backends=("a", "b"), weights=(1.0, 1.0))
    chunks = plan(config, route, list(range(40)))
    assert all(isinstance(c, Chunk) for c in chunks)
    a_chunks = [c for c in chunks if c.backend == "a"]
    b_chunks = [c for c in chunks if c.backend == "b"]
    assert [len(c.indices) for c in a_chunks] == [4, 4, 4, 4, 4]
    assert [len(c.indices) for c in b_chunks] == [10, 10]
    # interleaved row by row: a, b, a, b, then the rest of a
    assert [c.backend for c in chunks] == ["a", "b", "a", "b", "a", "a", "a"]
    # every index exactly once, and each chunk keeps its backend's own order
    assert sorted(i for c in chunks for i in c.indices) == list(range(40))
    for c in chunks:
        assert c.indices == sorted(c.indices)


def test_plan_last_chunk_holds_the_remainder():
    config = config_with_chunks({"a": 8})
    route = Route(name="a", backends=("a",), weights=(1.0,))
    chunks = plan(config, route, list(range(100)))
    assert [len(c.indices) for c in chunks] == [8] * 12 + [4]
    assert plan(config, route, []) == []


# --------------------------------------------------------------------------------------------
# route_shares: weight x free capacity, open circuits and backlog (embedded app, fakeredis)


def embedded_app(rpms: dict[str, float]) -> QrqCelery:
    backends = {
        name: Backend(
            name=name,
            kind="function",
            options=FunctionOptions(function="m:f"),
            chunk_size=1,
            limits=Limits(rpm=rpm),
            pool=Pool("threads", 4),
            retry=Retry(breaker_threshold=1, breaker_cooldown_s=60),
        )
        for name, rpm in rpms.items()
    }
    return QrqCelery(Config(redis_url=None, backends=backends, routes={}))


def test_route_shares_follow_rates_skip_open_circuits_and_count_backlog():
    app = embedded_app({"a": 600, "b": 1200, "c": 1800})
    route = Route(name="r", backends=("a", "b", "c"), weights=(1.0, 1.0, 1.0))
    assert route_shares(app, route, 300) == pytest.approx([50, 100, 150])
    # weights multiply the rates
    weighted = Route(name="w", backends=("a", "b", "c"), weights=(3.0, 1.0, 1.0))
    assert route_shares(app, weighted, 300) == pytest.approx([112.5, 75, 112.5])  # 3:2:3
    # a backlog on c's queue moves new work to a and b
    app.store.set("qrq:queued:qrq.c", 150)  # 150 samples waiting (capacity.QueuedSamples)
    shares = route_shares(app, route, 300)
    # all three finish together: (300 + 150) / 3600 min, so c gets 1800 * 0.125 - 150
    assert shares == pytest.approx([75, 150, 75])
    app.store.delete("qrq:queued:qrq.c")
    # an open circuit gets nothing
    app.flow.breaker("b").failure()
    assert app.flow.breaker("b").is_open()
    assert route_shares(app, route, 300) == pytest.approx([75, 0, 225])
