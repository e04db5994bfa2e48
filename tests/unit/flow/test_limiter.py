"""Unit tests of the global limiter on fakeredis, which runs the same Lua (Lua 5.1, TIME).

Time stands still unless a test moves it (`clock`), and the `sleeps` fixture records the
limiter's sleeps instead of passing them, so the booked schedule can be checked exactly and
fast, on a busy machine too. Real timing is in test_limiter_redis.py.
"""

from __future__ import annotations

import gc
import itertools
import re
import time
from types import SimpleNamespace

import fakeredis
import fakeredis.commands_mixins.server_mixin as fake_server
import pytest
import redis
from support import call, reply

import qreward_queue.flow.limiter as limiter_module
from qreward_queue.flow.limiter import Limiter, LimiterBusy, Reading, estimate_tokens
from qreward_queue.flow.ratelimit_headers import (
    NO_FEEDBACK,
    RateLimitHeaders,
    parse_duration,
    parse_retry_after,
)


@pytest.fixture(autouse=True)
def no_gc_pauses():
    """These tests read real time between calls; a full GC of the suite's heap can take tens of
    milliseconds, so it waits until each test is over."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.fixture
def fake() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis(server=fakeredis.FakeServer())


class Clock:
    """The tests' time: fakeredis's TIME (what the Lua reads) and the limiter's clocks stand
    still until a test moves them, so a busy machine cannot move a booked schedule. The
    limiter's own sleeps pass that much time, or only are recorded (`sleeps`)."""

    def __init__(self) -> None:
        self.now, self.mono = time.time(), 1000.0
        self.recorded: list[float] | None = None

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.mono += seconds

    def sleep(self, seconds: float) -> None:
        if self.recorded is None:
            self.advance(seconds)
        else:
            self.recorded.append(seconds)


@pytest.fixture(autouse=True)
def clock(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Clock:
    held = Clock()
    if request.node.get_closest_marker("real_clock"):  # waits in Redis (BLPOP, key TTLs)
        return held
    # only these two modules' clocks: other threads of this process keep the real one
    monkeypatch.setattr(fake_server, "time", SimpleNamespace(time=held.time))
    monkeypatch.setattr(limiter_module, "time", SimpleNamespace(
        sleep=held.sleep, monotonic=held.monotonic, time=held.time))
    return held


@pytest.fixture
def sleeps(clock: Clock) -> list[float]:
    """The limiter's sleeps, recorded instead of passed."""
    clock.recorded = []
    return clock.recorded


def book(limiter: Limiter, tokens: float = 0, max_wait_s: float = 60.0) -> float:
    """Acquire and release at once; return the granted wait."""
    with limiter.acquire(tokens=tokens, max_wait_s=max_wait_s) as grant:
        return grant.wait_s


# --- headers -------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "seconds"), [
    ("20ms", 0.02), ("1s", 1.0), ("1.5s", 1.5), ("6m0s", 360.0), ("1h2m3.5s", 3723.5),
    ("0s", 0.0), ("250us", 0.00025), (" 7 ", 7.0), ("0.5", 0.5),
])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "soon", "1x", "-1s", "s", "1s2", "nan", "-3", "inf"])
def test_parse_duration_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_parse_retry_after_seconds_and_http_date() -> None:
    assert parse_retry_after("2") == 2.0
    assert parse_retry_after("0.25") == 0.25
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == 10.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412490.0) == 0.0
    with pytest.raises(ValueError):
        parse_retry_after("later")


def test_headers_case_insensitive_and_garbage_is_none() -> None:
    h = RateLimitHeaders.from_headers({
        "X-RateLimit-Limit-Requests": "3000", "x-ratelimit-limit-tokens": "lots",
        "X-RATELIMIT-REMAINING-REQUESTS": "2999", "x-ratelimit-remaining-tokens": "-5",
        "x-ratelimit-reset-requests": "20ms", "x-ratelimit-reset-tokens": "6m0s",
        "Retry-After": "Thu, 32 Foo",
    })
    assert h == RateLimitHeaders(limit_requests=3000.0, remaining_requests=2999.0,
                                 reset_requests_s=0.02, reset_tokens_s=360.0)
    assert RateLimitHeaders.from_headers(None) == RateLimitHeaders()


def test_retry_after_ms_wins_over_retry_after() -> None:
    h = RateLimitHeaders.from_headers({"retry-after": "3", "retry-after-ms": "1500"})
    assert h.retry_after_s == 1.5


def test_estimate_tokens() -> None:
    assert estimate_tokens("abcde") == 2
    assert estimate_tokens("", max_output_tokens=16) == 16
    assert estimate_tokens("a" * 400, 100) == 200


# --- buckets -------------------------------------------------------------------------------

def test_keys_share_one_hash_tag(fake: fakeredis.FakeRedis) -> None:
    limiter = Limiter(fake, "judge-a", rpm=600, max_concurrent=2)
    with limiter.acquire():
        call(limiter, 429)  # another call, refused: its lease released, announced
        assert set(fake.keys()) == {b"qrq:{judge-a}:bucket", b"qrq:{judge-a}:leases",
                                    b"qrq:{judge-a}:aimd", b"qrq:{judge-a}:recent429",
                                    b"qrq:{judge-a}:released"}
    assert fake.zcard("qrq:{judge-a}:leases") == 0


def test_burst_then_steady_rate(
    fake: fakeredis.FakeRedis, sleeps: list[float], clock: Clock
) -> None:
    # Given rpm 600 (0.01/ms) with 1 s of burst: a full bucket holds 10 requests
    limiter = Limiter(fake, "b", rpm=600)
    # When 13 calls are booked in one round trip
    grants = limiter.reserve(13)
    # Then 10 start at once and each later one is booked 100 ms after the previous
    assert [g.wait_s for g in grants[:10]] == [0.0] * 10
    assert [g.wait_s for g in grants[10:]] == pytest.approx([0.1, 0.2, 0.3], abs=0.005)
    # And one more, booked later, queues behind all of them (start times, not waits)
    now = clock.time()  # fakeredis's TIME is this clock
    assert now + book(limiter) == pytest.approx(now + 0.4, abs=0.03)
    for g in grants:
        g.release(NO_FEEDBACK)
    assert fake.zcard("qrq:{b}:leases") == 0


def test_bulk_grants_stop_at_the_lease_limit(fake: fakeredis.FakeRedis) -> None:
    limiter = Limiter(fake, "b", max_concurrent=3)
    assert len(limiter.reserve(5)) == 3
    assert limiter.status()["leases_in_use"] == 3


def test_refused_request_takes_nothing(fake: fakeredis.FakeRedis, sleeps: list[float]) -> None:
    limiter = Limiter(fake, "b", rpm=60, max_concurrent=5)  # capacity 1, 1 per second
    assert book(limiter) == 0.0
    before = limiter.status()["limits"]["rpm"]["level"]
    with pytest.raises(LimiterBusy) as busy, limiter.acquire(max_wait_s=0.5):
        pass
    assert busy.value.wait_s == pytest.approx(1.0, abs=0.05)
    assert busy.value.reason == "rpm"
    assert limiter.status()["limits"]["rpm"]["level"] == pytest.approx(before, abs=0.05)
    assert limiter.status()["leases_in_use"] == 0


def test_weighted_and_fractional_tpm(fake: fakeredis.FakeRedis, sleeps: list[float]) -> None:
    limiter = Limiter(fake, "b", tpm=60_000)  # 1 token/ms, capacity 1000
    assert book(limiter, tokens=700) == 0.0
    assert book(limiter, tokens=300.5) == pytest.approx(0.0005, abs=0.01)
    # a fractional cost is booked exactly: the level is now about -0.5
    assert limiter.status()["limits"]["tpm"]["level"] == pytest.approx(-0.5, abs=60)
    assert book(limiter, tokens=400) == pytest.approx(0.4, abs=0.06)


def test_cost_above_capacity_waits_then_others_queue_behind(
    fake: fakeredis.FakeRedis, sleeps: list[float]
) -> None:
    limiter = Limiter(fake, "b", tpm=60_000)  # capacity 1000 tokens
    big = book(limiter, tokens=2500)
    assert big == pytest.approx((2500 - 1000) / 1000, abs=0.02)
    small = book(limiter, tokens=100)  # arrives later, is served after the big one
    assert small == pytest.approx(big + 0.1, abs=0.02)


def test_a_tpm_wait_does_not_let_rpm_burst(
    fake: fakeredis.FakeRedis, sleeps: list[float], clock: Clock
) -> None:
    # Given rpm 600 (burst 10) and a big TPM request that makes everyone wait 2 s
    limiter = Limiter(fake, "b", rpm=600, tpm=60_000)
    starts = []
    for tokens in [3000] + [10] * 30:
        now = clock.time()  # start times, not waits: real time passes between the bookings
        starts.append(now + book(limiter, tokens=tokens))
    starts = [s - starts[0] + 2.0 for s in starts]
    # served in booking order (the client's clock is read just before each booking)
    assert all(b >= a - 0.01 for a, b in itertools.pairwise(starts))
    # Then calls booked during the wait still start within RPM: burst 10, then 10 per second
    assert max(sum(t <= s < t + 1 for s in starts) for t in starts) <= 10 + 10 + 1
    assert starts[-1] - starts[0] == pytest.approx((31 - 10) / 10, abs=0.1)


def test_reported_usage_refunds_and_charges(fake: fakeredis.FakeRedis,
                                           sleeps: list[float]) -> None:
    limiter = Limiter(fake, "b", rpm=600, tpm=60_000)
    with limiter.acquire(tokens=800) as grant:
        reply(grant, 200, tokens=300)  # refund 500, booked with the release
    level = limiter.status()["limits"]["tpm"]["level"]
    assert level == pytest.approx(700, abs=100)  # refilled meanwhile at 1 token/ms
    with limiter.acquire(tokens=300) as grant:
        reply(grant, 200, tokens=2300)  # an overrun is charged: -2000
    assert limiter.status()["limits"]["tpm"]["level"] == pytest.approx(700 - 300 - 2000, abs=250)
    assert limiter.status()["limits"]["rpm"]["level"] == pytest.approx(8, abs=0.5)


def test_reported_usage_is_capped_and_noop_without_tpm(fake: fakeredis.FakeRedis) -> None:
    limiter = Limiter(fake, "b", tpm=60_000)
    with limiter.acquire(tokens=10) as grant:
        reply(grant, 200, tokens=-5000)
    assert limiter.status()["limits"]["tpm"]["level"] == 1000
    rpm_only = Limiter(fake, "c", rpm=60)
    with rpm_only.acquire(tokens=10) as grant:
        reply(grant, 200, tokens=99999)
    assert rpm_only.status()["limits"]["rpm"]["level"] == pytest.approx(0, abs=0.05)


def test_bucket_expires_once_full_again(fake: fakeredis.FakeRedis) -> None:
    limiter = Limiter(fake, "b", rpm=600)  # one request refills in 100 ms
    with limiter.acquire():
        assert 1000 < fake.pttl("qrq:{b}:bucket") <= 1100
        assert 60_000 < fake.pttl("qrq:{b}:leases") <= 61_000


# --- leases --------------------------------------------------------------------------------

@pytest.mark.real_clock
def test_no_free_lease_polls_then_gives_up(fake: fakeredis.FakeRedis,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    limiter = Limiter(fake, "b", max_concurrent=2)
    blocks: list[float] = []
    monkeypatch.setattr(fake, "blpop", lambda keys, timeout: blocks.append(timeout))
    with limiter.acquire(), limiter.acquire():
        with pytest.raises(LimiterBusy) as busy, limiter.acquire(max_wait_s=0.2):
            pass
        assert busy.value.reason == "lease"
        # short, jittered waits for a release (never 0: BLPOP's "for ever")
        assert blocks and all(0 < s <= 0.04 for s in blocks)
        assert limiter.status()["leases_in_use"] == 2
    assert limiter.status()["leases_in_use"] == 0
    assert book(limiter) == 0.0


def test_a_release_is_announced_to_waiters_and_stale_news_dropped(
        fake: fakeredis.FakeRedis) -> None:
    limiter = Limiter(fake, "b", max_concurrent=2)
    released = "qrq:{b}:released"
    first, second = limiter.reserve(2)
    reply(first, 200)
    assert fake.llen(released) == 1  # a waiter anywhere wakes on it
    (third,) = limiter.reserve(1)  # takes the freed lease: no lease left, the news is stale
    assert fake.llen(released) == 0
    reply(second, 200)
    reply(third, 200)
    assert fake.llen(released) == 2
    assert 0 < fake.pttl(released) <= 1000
    no_cap = Limiter(fake, "n")  # no max_concurrent: nobody waits for a lease, nothing said
    call(no_cap, 200)
    assert not fake.exists("qrq:{n}:released")


def test_lease_released_when_the_block_raises(fake: fakeredis.FakeRedis) -> None:
    limiter = Limiter(fake, "b", max_concurrent=1)
    with pytest.raises(RuntimeError), limiter.acquire():
        raise RuntimeError("backend exploded")
    assert limiter.status()["leases_in_use"] == 0


def test_successes_are_held_back_to_be_finished_together(fake: fakeredis.FakeRedis) -> None:
    # Given a limiter that holds successes back up to 5 s to send their finishes together
    limiter = Limiter(fake, "b", max_concurrent=4, finish_delay_s=5.0)
    grants = limiter.reserve(3)
    # When each of the three calls succeeds, the first long after the limiter was made
    time.sleep(0.01)
    for grant in grants:
        reply(grant, 200)
    # Then none was sent alone: their leases are held until the flush sends all three at once
    assert limiter.status()["leases_in_use"] == 3
    limiter.flush()
    assert limiter.status()["leases_in_use"] == 0
    # and a success whose reply told the limits is learnt at once, with those held back
    quiet, telling = limiter.reserve(2)
    reply(quiet, 200)
    reply(telling, 200, {"x-ratelimit-remaining-requests": "7"})
    assert limiter.status()["leases_in_use"] == 0


@pytest.mark.real_clock
def test_abandoned_lease_expires_after_ttl(fake: fakeredis.FakeRedis) -> None:
    limiter = Limiter(fake, "b", max_concurrent=1, lease_ttl_s=0.3)
    held = limiter.acquire()
    held.__enter__()  # never exits: like a killed worker
    with pytest.raises(LimiterBusy), limiter.acquire(max_wait_s=0.1):
        pass
    time.sleep(0.3)
    with limiter.acquire(max_wait_s=0.1) as grant:
        assert grant.wait_s == 0.0


# --- feedback: pause, header sync, AIMD -------------------------------------------------------

def test_429_pauses_new_and_booked_requests(
    fake: fakeredis.FakeRedis, monkeypatch: pytest.MonkeyPatch, clock: Clock) -> None:
    limiter = Limiter(fake, "b", rpm=600)  # capacity 10
    slept: list[float] = []

    def sleep(seconds: float) -> None:  # another call gets a 429 while this one sleeps
        if not slept:
            reply(in_flight, 429, {"Retry-After": "2"})
        slept.append(seconds)

    burst_at = clock.time()  # fakeredis's TIME is this clock: the bucket refills meanwhile
    burst = limiter.reserve(10)  # the burst, booked at once; one of its calls still in flight
    in_flight = burst.pop()
    for grant in burst:
        grant.release(NO_FEEDBACK)
    fake_time = SimpleNamespace(sleep=sleep, monotonic=clock.monotonic, time=clock.time)
    monkeypatch.setattr(limiter_module, "time", fake_time)
    # Given a request booked 100 ms after the burst, when the 429 comes during its wait,
    # then it sleeps its wait and then the pause on top of it
    booked_at = clock.time()
    wait = book(limiter)
    assert wait == pytest.approx(0.1 - (booked_at - burst_at), abs=0.02)
    assert slept == pytest.approx([wait, 2.0], abs=0.02)
    status = limiter.status()
    assert status["paused_for_s"] == pytest.approx(2.0, abs=0.05)
    assert status["recent_429s"] == 1
    # and a new request waits out the pause plus the moved schedule
    assert book(limiter) == pytest.approx(2.0 + 0.1 + 0.1, abs=0.05)


def test_a_burst_of_429s_pauses_once(fake: fakeredis.FakeRedis, sleeps: list[float]) -> None:
    limiter = Limiter(fake, "b", rpm=600)
    *five, sixth = limiter.reserve(6)  # six calls in flight
    for grant in five:  # five of them all come back 429
        reply(grant, 429, {"Retry-After": "2"})
    assert limiter.status()["paused_for_s"] == pytest.approx(2.0, abs=0.05)
    assert book(limiter) == pytest.approx(2.0 + 0.1, abs=0.05)
    reply(sixth, 429, {"Retry-After": "3"})  # a longer one extends the pause
    assert limiter.status()["paused_for_s"] == pytest.approx(3.0, abs=0.05)
    assert book(limiter) == pytest.approx(3.0 + 0.2, abs=0.05)


@pytest.mark.parametrize(("headers", "pause"), [
    ({"retry-after": "3"}, 3.0),
    ({"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1.5s",
      "x-ratelimit-remaining-tokens": "5000", "x-ratelimit-reset-tokens": "20s"}, 1.5),
    ({}, 0.0),  # nothing usable: no pause of everyone, the call backs off with jitter
])
def test_429_pause_length(fake: fakeredis.FakeRedis, headers: dict, pause: float) -> None:
    limiter = Limiter(fake, "b", rpm=600, tpm=60_000)
    call(limiter, 429, headers)
    assert limiter.status()["paused_for_s"] == pytest.approx(pause, abs=0.05)


def test_manual_pause_drops_the_burst(fake: fakeredis.FakeRedis, sleeps: list[float]) -> None:
    limiter = Limiter(fake, "b", rpm=600)
    limiter.pause(0.5)
    assert book(limiter) == pytest.approx(0.6, abs=0.02)


def test_429_pauses_a_backend_without_rate_limits(
    fake: fakeredis.FakeRedis, sleeps: list[float]
) -> None:
    limiter = Limiter(fake, "b", max_concurrent=4)
    call(limiter, 429, {"retry-after": "1"})
    with limiter.acquire() as grant:
        assert grant.wait_s == pytest.approx(1.0, abs=0.02)
    with pytest.raises(LimiterBusy) as busy, limiter.acquire(max_wait_s=0.5):
        pass
    assert busy.value.reason == "paused"


def test_remaining_header_lowers_the_level(fake: fakeredis.FakeRedis, sleeps: list[float]) -> None:
    limiter = Limiter(fake, "b", rpm=600, tpm=60_000)
    call(limiter, 200, {"x-ratelimit-remaining-requests": "3",
                        "x-ratelimit-remaining-tokens": "900000",
                        "x-ratelimit-reset-tokens": "6m0s"})
    status = limiter.status()["limits"]
    assert status["rpm"]["level"] == pytest.approx(3, abs=0.1)
    assert status["tpm"]["level"] == 1000  # a higher remaining changes nothing
    assert status["tpm"]["reset_in_s"] == pytest.approx(360, abs=1)
    assert [g.wait_s for g in limiter.reserve(4)][-1] == pytest.approx(0.1, abs=0.05)


def test_a_lower_limit_header_is_believed_from_three_replies_until_it_rises(
    fake: fakeredis.FakeRedis,
) -> None:
    limiter = Limiter(fake, "b", rpm=6000)
    for told in ("1", "3000", "2000"):  # one reply's word changes nothing...
        call(limiter, 200, {"x-ratelimit-limit-requests": told})
        rpm = limiter.status()["limits"]["rpm"]
        if told != "2000":
            assert rpm["per_minute"] == 6000 and not rpm["learned"]["believed"], rpm
    # ...the third agreeing one does: the most generous of them, with the reason shown
    assert (rpm["per_minute"], rpm["capacity"], rpm["configured_per_minute"]) == pytest.approx(
        (3000, 50, 6000), rel=0.01)  # (relaxing back from the moment it was believed)
    assert rpm["learned"] == {"believed": True, "told_per_minute": 3000, "by": "agreeing replies",
                              "age_s": pytest.approx(0, abs=0.5), "replies": 3}
    call(limiter, 200, {"x-ratelimit-limit-requests": "9000"})  # never above the config
    rpm = limiter.status()["limits"]["rpm"]
    assert rpm["per_minute"] == 6000 and rpm["learned"] is None


def test_a_429_saying_a_lower_limit_is_believed_at_once(fake: fakeredis.FakeRedis) -> None:
    limiter = Limiter(fake, "b", rpm=6000)
    call(limiter, 429, {"x-ratelimit-limit-requests": "600"})
    rpm = limiter.status()["limits"]["rpm"]
    assert rpm["per_minute"] == pytest.approx(600, rel=0.01) and rpm["learned"]["by"] == "a 429"


def test_a_believed_lower_limit_relaxes_back_unless_confirmed(
    fake: fakeredis.FakeRedis, clock: Clock
) -> None:
    limiter = Limiter(fake, "b", rpm=6000, learned_relax_s=0.5)
    for _ in range(3):
        call(limiter, 200, {"x-ratelimit-limit-requests": "600"})
    assert limiter.status()["limits"]["rpm"]["per_minute"] == pytest.approx(600, rel=0.1)
    clock.advance(1.0)  # two doublings: 600 -> 2400
    assert limiter.status()["limits"]["rpm"]["per_minute"] == pytest.approx(2400, rel=0.15)
    call(limiter, 200, {"x-ratelimit-limit-requests": "600"})  # confirmed again: back down
    assert limiter.status()["limits"]["rpm"]["per_minute"] == pytest.approx(600, rel=0.1)
    clock.advance(2.0)  # unconfirmed for long: the configured limit again
    assert limiter.status()["limits"]["rpm"]["per_minute"] == 6000


def test_aimd_halves_once_per_cooldown_and_recovers(
    fake: fakeredis.FakeRedis, clock: Clock
) -> None:
    limiter = Limiter(fake, "b", max_concurrent=16, aimd_cooldown_s=1.0)
    for _ in range(5):  # one burst of 429s halves once
        call(limiter, 429, {"retry-after": "0"})
    assert limiter.status()["adaptive_limit"] == 8
    clock.advance(1.05)
    call(limiter, 429, {"retry-after": "0"})
    assert limiter.status()["adaptive_limit"] == 4
    call(limiter, 200)  # no growth while cooling down from the cut
    clock.advance(1.05)
    for expected in (5, 6):
        for _ in range(expected - 1):  # `limit` successes add one
            call(limiter, 200)
        assert limiter.status()["adaptive_limit"] == expected
    for _ in range(1500):  # near the last cut (8) growth is slower; above it fast again
        call(limiter, 200)
    assert limiter.status()["adaptive_limit"] == 16  # capped at the configured maximum


def test_rare_timeouts_are_faults_and_timeouts_that_grow_are_congestion(
    fake: fakeredis.FakeRedis,
) -> None:
    limiter = Limiter(fake, "b", max_concurrent=64, aimd_cooldown_s=0)
    # a steady 0.5% of calls hanging past the timeout: a fault to retry, no cut
    for n in range(1, 2001):
        call(limiter, None, timed_out=True) if n % 200 == 0 else \
            call(limiter, 200)
    status = limiter.status()
    assert status["adaptive_limit"] == 64
    assert "faults, not congestion" in status["adaptive_why"]
    # timeouts on a growing share of calls (an overloaded server): congestion, cut
    for n in range(1, 41):
        call(limiter, None, timed_out=True) if n % 4 == 0 else \
            call(limiter, 200)
    status = limiter.status()
    assert status["adaptive_limit"] < 64
    assert re.fullmatch(r"cut \d+ -> \d+: timeouts on \d+% of recent calls", status["adaptive_why"])


def test_congestion_429_cuts_concurrency_gently_near_the_last_cut_and_pauses_no_one(
    fake: fakeredis.FakeRedis,
) -> None:
    limiter = Limiter(fake, "b", rpm=6000, max_concurrent=64, aimd_cooldown_s=0)
    congested = {"retry-after-ms": "200", "x-ratelimit-remaining-requests": "90"}
    # a 429 with requests left: too many in flight, not an exhausted rate
    assert call(limiter, 429, congested) == Reading(pause_s=0.0, flow_control=True)
    status = limiter.status()
    assert (status["adaptive_limit"], status["paused_for_s"], status["recent_429s"]) == (32, 0, 1)
    call(limiter, 429, congested)  # far below the last cut (64): halves again
    assert limiter.status()["adaptive_limit"] == 16
    for _ in range(sum(range(16, 28))):  # +1 per `limit` successes up to near the last cut
        call(limiter, 200)
    assert limiter.status()["adaptive_limit"] == 28
    for _ in range(16 * 28 - 1):  # near the last cut (32) the server's limit is probed slowly
        call(limiter, 200)
    assert limiter.status()["adaptive_limit"] == 28
    call(limiter, 200)
    assert limiter.status()["adaptive_limit"] == 29
    call(limiter, 429, congested)  # back near the last cut: a gentle cut (10%), no halving
    assert limiter.status()["adaptive_limit"] == 27
    # an exhausted rate still pauses everyone and leaves the concurrency alone
    paused = call(limiter, 429, {"retry-after": "2", "x-ratelimit-remaining-requests": "0"})
    assert paused.pause_s == 2.0 and limiter.status()["adaptive_limit"] == 27


@pytest.mark.real_clock
def test_aimd_floor_and_lease_cap(fake: fakeredis.FakeRedis, sleeps: list[float]) -> None:
    limiter = Limiter(fake, "b", max_concurrent=3, aimd_cooldown_s=0)
    for _ in range(4):
        call(limiter, 429, {"retry-after": "0"})
    assert limiter.status()["adaptive_limit"] == 1
    with limiter.acquire(), pytest.raises(LimiterBusy), limiter.acquire(max_wait_s=0.1):
        pass


def test_no_aimd_without_max_concurrent(fake: fakeredis.FakeRedis) -> None:
    limiter = Limiter(fake, "b", rpm=600)
    call(limiter, 429, {"retry-after": "0"})
    call(limiter, 500, {"x-ratelimit-remaining-requests": "1"})
    status = limiter.status()
    assert (status["adaptive_limit"], status["max_concurrent"]) == (None, None)
    assert status["limits"]["rpm"]["level"] == pytest.approx(1, abs=0.1)


# --- Redis outages and status -----------------------------------------------------------------

class FlakyRedis(fakeredis.FakeRedis):
    """Fails every command with ConnectionError while `down` is positive (counting down)."""

    down = 0

    def execute_command(self, *args, **kwargs):
        if self.down > 0:
            self.down -= 1
            raise redis.ConnectionError("connection refused (test)")
        return super().execute_command(*args, **kwargs)


def test_waits_out_a_redis_outage(sleeps: list[float]) -> None:
    client = FlakyRedis(server=fakeredis.FakeServer())
    limiter = Limiter(client, "b", rpm=600, max_concurrent=2)
    client.down = 4
    assert book(limiter) == 0.0
    assert len(sleeps) == 4 and sleeps == sorted(sleeps)  # growing backoff


@pytest.mark.real_clock
def test_raises_after_outage_wait() -> None:
    client = FlakyRedis(server=fakeredis.FakeServer())
    limiter = Limiter(client, "b", rpm=600, outage_wait_s=0.3)
    client.down = 10**6
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        limiter.status()
    # deadline promise: a call gives up on an unreachable Redis after outage_wait_s
    assert 0.3 <= time.monotonic() - started < 1.0



def test_only_429s_the_limiter_acts_on_are_flow_control(fake: fakeredis.FakeRedis) -> None:
    # a usable Retry-After pauses everyone, a congested 429 cuts the adaptive concurrency: both
    # are the limiter's pace; a bare 429 (nothing usable) and a success are not
    limiter = Limiter(fake, "b", rpm=6000, max_concurrent=64)
    assert call(limiter, 429, {"retry-after": "1"}) == Reading(1.0, flow_control=True)
    congested = {"x-ratelimit-remaining-requests": "90"}
    assert call(limiter, 429, congested) == Reading(0.0, flow_control=True)
    assert call(limiter, 429, {"retry-after": "soon-ish"}) == Reading(0.0, False)
    assert call(limiter, 200) == Reading()
    # without max_concurrent no cut is made: a congested 429 then paces nothing
    unbounded = Limiter(fake, "c", rpm=6000)
    assert call(unbounded, 429, congested) == Reading(0.0, False)
