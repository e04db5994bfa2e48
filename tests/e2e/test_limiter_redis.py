"""Acceptance tests of the global limiter on real Redis, with real threads and processes.

Rates are measured with the tests' own clocks and counters; tolerances allow for a loaded
2-core machine but not for a limiter that lets through more (or much less) than it should.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import threading
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from support import call, free_port, reply

from qreward_queue import keys
from qreward_queue.flow.limiter import Limiter, LimiterBusy
from qreward_queue.flow.ratelimit_headers import NO_FEEDBACK

SPAWN = mp.get_context("spawn")


def _hammer(url: str, backend: str, kwargs: dict, threads: int, duration_s: float,
            go, results, skew_s: float = 0.0) -> None:
    """A worker process: `threads` threads acquire in a loop; report their start times."""
    real_time = time.time
    if skew_s:  # this machine's clock is hours off: the limiter must not care
        real_monotonic = time.monotonic
        time.time = lambda: real_time() + skew_s
        time.monotonic = lambda: real_monotonic() + skew_s
    limiter = Limiter(redis.Redis.from_url(url), backend, **kwargs)
    starts: list[float] = []
    results.put("ready")
    go.wait()
    end = real_time() + duration_s

    def loop() -> None:
        while real_time() < end:
            try:
                with limiter.acquire(max_wait_s=2.0):
                    starts.append(real_time())
            except LimiterBusy as busy:
                time.sleep(min(busy.wait_s, 0.05))

    pool = [threading.Thread(target=loop) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    results.put(starts)


def hammer(url: str, backend: str, kwargs: dict, duration_s: float, skews: list[float],
           threads: int = 4, during=None) -> list[list[float]]:
    """Run one `_hammer` process per entry of `skews`; call `during()` once they all run."""
    go, results = SPAWN.Event(), SPAWN.Queue()
    procs = [SPAWN.Process(target=_hammer, args=(url, backend, kwargs, threads, duration_s,
                                                  go, results, skew)) for skew in skews]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            assert results.get(timeout=30) == "ready"
        go.set()
        if during:
            during()
        starts = [results.get(timeout=duration_s + 30) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return starts


def count(starts: list[float], begin: float, end: float) -> int:
    return sum(begin <= s < end for s in starts)


def test_grant_rate_matches_rpm_plus_burst(redis_url: str) -> None:
    # Given rpm 1200 (20/s, burst 20) and 3 processes x 4 threads hammering for 10 s
    per_proc = hammer(redis_url, "rate", {"rpm": 1200}, duration_s=11, skews=[0, 0, 0])
    starts = sorted(s for proc in per_proc for s in proc)
    t0 = starts[0]
    # Then a 10 s window holds the burst plus 10 s of refill, within 5%
    expected = 20 + 20 * 10
    assert abs(count(starts, t0, t0 + 10) - expected) <= 0.05 * expected
    assert abs(count(starts, t0 + 1, t0 + 10) - 180) <= 0.05 * 180
    assert all(len(proc) > 30 for proc in per_proc)  # every process got a share


def test_skewed_clocks_share_one_rate(redis_url: str) -> None:
    # Given two processes whose clocks are 3 h ahead and 2 h behind
    per_proc = hammer(redis_url, "skew", {"rpm": 1200}, duration_s=5,
                      skews=[3 * 3600.0, -2 * 3600.0])
    starts = sorted(s for proc in per_proc for s in proc)
    # Then together they get one rate (server clock), not one each
    expected = 20 + 20 * 4
    assert abs(count(starts, starts[0], starts[0] + 4) - expected) <= 0.06 * expected
    assert all(len(proc) >= 0.25 * len(starts) for proc in per_proc)


def test_429_pauses_every_process(redis_url: str) -> None:
    pause: dict[str, float] = {}

    def send_429() -> None:  # a call of a third worker that comes back 429 after 1.5 s
        limiter = Limiter(redis.Redis.from_url(redis_url), "pause", rpm=600)
        (grant,) = limiter.reserve(1)
        time.sleep(1.5)
        reply(grant, 429, {"Retry-After": "2"})
        pause["at"] = time.time()  # the pause is in force from here (at the latest)

    per_proc = hammer(redis_url, "pause", {"rpm": 600}, duration_s=5, skews=[0, 0],
                      during=send_429)
    starts = sorted(s for proc in per_proc for s in proc)
    at = pause["at"]
    # Then nobody starts during the 2 s (calls already past their checkpoint may go at once),
    assert count(starts, at + 0.05, at + 1.95) == 0
    # both processes resume right after it, at the rate and without a burst
    assert all(count(proc, at + 1.95, at + 2.6) > 0 for proc in per_proc)
    assert 7 <= count(starts, at + 2.0, at + 3.0) <= 13


def test_a_grant_waiting_through_pauses_starts_once_they_end(redis_url: str) -> None:
    # Given grants of a 600 rpm limiter, the last booked to wait (the burst is spent)
    store = redis.Redis.from_url(redis_url)
    limiter = Limiter(store, "shifted", rpm=600)
    grants = limiter.reserve(30)
    assert grants[-1].wait_s > 0
    # When 429s order pauses of fractional lengths while it sleeps, each extending the last,
    # until the schedule's total shift is one that JSON's 14 digits round down
    for k, grant in enumerate(grants[:-1]):
        reply(grant, 429, {"retry-after-ms": f"{100 + 37.3 * k:.1f}"})
        shift = float(store.hget(keys.limiter("shifted")["bucket"], "shift") or 0)
        if float(f"{shift:.14g}") < shift:
            break
    else:
        pytest.skip("no pause left a shift that 14 digits round down")
    started = threading.Event()

    def wait() -> None:
        grants[-1].wait()
        started.set()

    threading.Thread(target=wait, daemon=True).start()
    # Then the waiting grant starts once they end (it checked in with the limiter for ever,
    # renewing its lease, when the shift it had seen came back rounded and never matched)
    assert started.wait(10), "the grant never started"


def test_header_sync_lowers_level_and_rate(redis_url: str) -> None:
    # Given a config of rpm 6000 while the server enforces 3000
    limiter = Limiter(redis.Redis.from_url(redis_url), "sync", rpm=6000)
    for _ in range(3):  # a lower limit is believed once three replies agree
        call(limiter, 200, {"x-ratelimit-limit-requests": "3000",
                            "x-ratelimit-remaining-requests": "0"})
    rpm = limiter.status()["limits"]["rpm"]
    assert rpm["per_minute"] == pytest.approx(3000, rel=0.01)
    assert rpm["level"] == pytest.approx(0, abs=1)
    # Then the measured rate is the server's (50/s), not the config's (100/s)
    per_proc = hammer(redis_url, "sync", {"rpm": 6000}, duration_s=3, skews=[0])
    starts = sorted(per_proc[0])
    rate = count(starts, starts[0] + 0.5, starts[0] + 2.5) / 2.0
    assert 45 <= rate <= 55


def test_weighted_and_fractional_costs(redis_client: redis.Redis) -> None:
    limiter = Limiter(redis_client, "weights", tpm=600)  # 10 tokens/s, capacity 10
    grants = limiter.reserve(4, tokens=2.5)  # booked in one round trip
    assert [g.wait_s for g in grants] == [0, 0, 0, 0]
    for grant in grants:
        grant.release(NO_FEEDBACK)
    assert limiter.status()["limits"]["tpm"]["level"] == pytest.approx(0, abs=0.1)
    started = time.monotonic()
    with limiter.acquire(tokens=0.25) as grant:  # a quarter token needs 25 ms
        waited = time.monotonic() - started
    assert grant.wait_s == pytest.approx(0.025, abs=0.012)
    assert waited == pytest.approx(grant.wait_s, abs=0.03)
    with limiter.acquire(tokens=5) as grant:  # a heavier request waits proportionally longer
        assert grant.wait_s == pytest.approx(0.5, abs=0.03)


def test_cost_above_capacity_is_served_and_later_ones_wait_behind(redis_url: str) -> None:
    # Given tpm 60000 (1000 tokens/s, capacity 1000) and a request of 2500 tokens
    started: dict[str, float] = {}

    limiters = {name: Limiter(redis.Redis.from_url(redis_url), "big", tpm=60_000)
                for name in ("big", "small1", "small2")}
    for limiter in limiters.values():
        limiter.status()  # connected and scripts loaded before the clock starts

    def call(name: str, tokens: float, delay_s: float) -> None:
        time.sleep(delay_s)
        with limiters[name].acquire(tokens=tokens, max_wait_s=10):
            started[name] = time.monotonic()

    t0 = time.monotonic()
    threads = [threading.Thread(target=call, args=args)
               for args in (("big", 2500, 0), ("small1", 100, 0.2), ("small2", 100, 0.4))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Then it starts after (cost - capacity) / rate, and the small ones are served after it,
    # each 100 tokens = 0.1 s later (booked behind it, not in front)
    assert started["big"] - t0 == pytest.approx(1.5, abs=0.15)
    assert started["small1"] - started["big"] == pytest.approx(0.1, abs=0.05)
    assert started["small2"] - started["small1"] == pytest.approx(0.1, abs=0.05)


def test_50_threads_never_exceed_max_concurrent(redis_client: redis.Redis) -> None:
    limiter = Limiter(redis_client, "conc", max_concurrent=8)
    lock = threading.Lock()
    state = {"in_use": 0, "peak": 0, "calls": 0}

    def worker() -> None:
        for _ in range(6):
            with limiter.acquire(max_wait_s=30):
                with lock:
                    state["in_use"] += 1
                    state["peak"] = max(state["peak"], state["in_use"])
                time.sleep(random.uniform(0.01, 0.03))
                with lock:
                    state["in_use"] -= 1
                    state["calls"] += 1

    threads = [threading.Thread(target=worker) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert state["calls"] == 300
    assert 6 <= state["peak"] <= 8
    assert limiter.status()["leases_in_use"] == 0


def _hold_lease(url: str, results) -> None:
    limiter = Limiter(redis.Redis.from_url(url), "kill", max_concurrent=1, lease_ttl_s=1.5)
    with limiter.acquire():
        results.put(time.monotonic())
        time.sleep(60)


def test_a_lease_released_in_one_process_wakes_a_waiter_in_another(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given two workers' limiters sharing max_concurrent 1, the lease held by the first, and
    # the second's waits for a release made 10 s long (a poll would take that long)
    holder, waiter = (Limiter(redis.Redis.from_url(redis_url), "handoff", max_concurrent=1)
                      for _ in range(2))
    (held,) = holder.reserve(1)
    monkeypatch.setattr("qreward_queue.flow.limiter.random.uniform", lambda a, b: 400.0)
    granted = threading.Event()
    blocking = threading.Event()
    real_blpop = waiter._redis.blpop

    def blpop(*args, **kwargs):
        blocking.set()
        return real_blpop(*args, **kwargs)

    monkeypatch.setattr(waiter._redis, "blpop", blpop)
    thread = threading.Thread(target=lambda: (waiter.reserve(1), granted.set()), daemon=True)
    thread.start()
    assert blocking.wait(10)
    # When the first finishes its call, the second gets the lease at once, not a poll later
    reply(held, 200)
    assert granted.wait(5)
    thread.join(5)


def test_lease_of_a_killed_process_lapses_after_its_ttl(redis_url: str) -> None:
    results = SPAWN.Queue()
    holder = SPAWN.Process(target=_hold_lease, args=(redis_url, results))
    holder.start()
    granted_at = results.get(timeout=30)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join()
    limiter = Limiter(redis.Redis.from_url(redis_url), "kill", max_concurrent=1)
    while True:
        try:
            with limiter.acquire(max_wait_s=0):
                reclaimed_at = time.monotonic()
                break
        except LimiterBusy:  # held until the ttl: it may lapse between these two calls
            held = limiter.status()["leases_in_use"]
            assert held == 1 or time.monotonic() - granted_at >= 1.45, held
            time.sleep(0.02)
    # deadline promise: a dead holder's lease lapses after its lease_ttl_s (1.5 s), not later
    assert 1.4 <= reclaimed_at - granted_at <= 1.8


def test_aimd_shared_by_limiters(redis_url: str) -> None:
    a, b = (Limiter(redis.Redis.from_url(redis_url), "aimd", max_concurrent=16,
                    aimd_cooldown_s=1.0) for _ in range(2))
    for limiter in (a, b, a, b):  # a burst of 429s from two workers: one decrease
        call(limiter, 429, {"retry-after": "0"})
    assert b.status()["adaptive_limit"] == 8
    time.sleep(1.05)
    call(a, 429, {"retry-after": "0"})
    assert b.status()["adaptive_limit"] == 4
    # the lowered limit caps the leases of every limiter
    with a.acquire(), a.acquire(), b.acquire(), b.acquire():
        assert b.status()["leases_in_use"] == 4
        with pytest.raises(LimiterBusy), a.acquire(max_wait_s=0.1):
            pass
    time.sleep(1.05)  # no growth while cooling down from the cut
    for _ in range(4 + 5):  # `limit` successes add one: 4 -> 5 -> 6
        call(a if random.random() < 0.5 else b, 200)
    assert a.status()["adaptive_limit"] == 6




@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs the redis-server binary")
def test_waits_out_a_redis_outage_then_raises() -> None:
    # Given a limiter pointed at a port where Redis starts only 1 s later (a wait that never
    # ends raises after outage_wait_s: the bound of a hang)
    port = free_port()
    limiter = Limiter(redis.Redis(port=port), "outage", rpm=600, max_concurrent=4,
                      outage_wait_s=60)
    servers: list[subprocess.Popen] = []
    starter = threading.Timer(1.0, lambda: servers.append(subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL)))
    started = time.monotonic()
    starter.start()
    try:
        with limiter.acquire():  # Then the call waits for it instead of failing
            assert limiter.status()["leases_in_use"] == 1
    finally:
        starter.join()
        for server in servers:
            server.terminate()
            server.wait()
    assert time.monotonic() - started >= 1.0
    # and when Redis never comes back, the call raises after outage_wait_s (this client does
    # not retry on its own; redis-py's default retries add up to a few seconds per attempt)
    client = redis.Redis(port=free_port(), retry=Retry(NoBackoff(), 0))
    dead = Limiter(client, "outage", rpm=600, outage_wait_s=1.0)
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError), dead.acquire():
        pass
    # deadline promise: a call gives up on an unreachable Redis after outage_wait_s
    assert 1.0 <= time.monotonic() - started < 2.0
