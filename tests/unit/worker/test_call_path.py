"""Unit tests of `CallPath`, one layer at a time, outermost first: breaker, limiter,
clearance, transport, feedback, then the async face and its hedge.

A fake backend kind scripts the replies; the limiter, breaker and ledger are the real ones on
fakeredis. No HTTP server, no processes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

import fakeredis
import pytest
from prometheus_client import CollectorRegistry

from qreward_queue.backends import BackendClient, Call, JudgeOptions
from qreward_queue.config.model import Backend, Budget, Retry
from qreward_queue.errors import (
    BudgetExceeded,
    Cancelled,
    LimiterBusy,
    PermanentError,
    RateLimited,
    ScoringError,
    TransientError,
)
from qreward_queue.flow.breaker import CircuitBreaker
from qreward_queue.flow.limiter import Limiter
from qreward_queue.flow.ratelimit_headers import NO_FEEDBACK, Feedback
from qreward_queue.flow.spend import Ledger, backend_spend, batch_spend
from qreward_queue.ops import metrics
from qreward_queue.worker import call_path
from qreward_queue.worker.call_path import CallPath

BATCH = [{"prompt": "2+2?", "response": "4"}]  # 5 bytes to read
BATCH_ID = "batch-1"
CONFIG = Backend(name="judge-u", kind="judge", options=JudgeOptions(url="http://judge.invalid/v1",
                 model="m"))
HEDGE_AFTER_S = 0.01  # a reply later than this gets a hedge


@dataclass
class Slow:
    """An answer that comes after `seconds` (None: never, until cancelled)."""

    seconds: float | None
    answer: Call | BaseException | None = None


Answer = Call | BaseException | Slow


class FakeKind(BackendClient):
    """A backend kind whose calls take the scripted answers in turn; it counts its calls, the
    calls cancelled mid-way, and can look at the world while a call is in flight."""

    awaitable = True

    def __init__(self, config: Backend, *answers: Answer) -> None:
        super().__init__(config)
        self.answers = list(answers)
        self.calls = 0
        self.cancelled = 0
        self.during: list[object] = []
        self.look = lambda: None  # what to record while a call is in flight

    def _next(self) -> Answer:
        self.calls += 1
        self.during.append(self.look())
        return self.answers.pop(0)

    def call(self, samples: list[dict]) -> Call:
        answer = self._next()
        assert not isinstance(answer, Slow), "a Slow answer is for call_async"
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def call_async(self, samples: list[dict]) -> Call:
        answer = self._next()
        if isinstance(answer, Slow):
            try:
                await (asyncio.sleep(answer.seconds) if answer.seconds is not None
                       else asyncio.Event().wait())
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            answer = answer.answer
        if isinstance(answer, BaseException):
            raise answer
        assert answer is not None
        return answer

    def feedback(self, result: Call | ScoringError) -> Feedback:
        timed_out = isinstance(result, ScoringError) and result.timed_out
        return Feedback.from_http(result.status_code, result.headers, timed_out)


def ok(score: float = 1.0, usage: tuple[int, int] | None = None) -> Call:
    return Call([score], status_code=200, headers={}, usage=usage)


def rate_limited(headers: dict[str, str]) -> RateLimited:
    return RateLimited("rate limited (429)", status_code=429, headers=headers,
                       retry_after_s=1.0)


@pytest.fixture
def store() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis(server=fakeredis.FakeServer())


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> CollectorRegistry:
    """The worker metrics, switched on for the test in a registry of its own."""
    registry = CollectorRegistry()
    monkeypatch.setattr(metrics, "_metrics", metrics._WorkerMetrics(registry))
    return registry


def make_path(monkeypatch: pytest.MonkeyPatch, client: FakeKind, *,
              limiter: Limiter | None = None, breaker: CircuitBreaker | None = None,
              may_refuse: bool = True, stop: str | None = None,
              ledger: Ledger | None = None) -> CallPath:
    monkeypatch.setattr(call_path, "make_backend", lambda _config: client)
    return CallPath(client.config, limiter, breaker, may_refuse, lambda: stop, ledger, BATCH_ID)


def hedged(monkeypatch: pytest.MonkeyPatch, *answers: Answer, limiter: Limiter | None = None,
           config: Backend = CONFIG) -> tuple[FakeKind, CallPath]:
    """A fake kind scripted with `answers`, and its call path hedging replies later than
    HEDGE_AFTER_S."""
    client = FakeKind(config, *answers)
    path = make_path(monkeypatch, client, limiter=limiter)
    path.hedge_after_s = lambda: HEDGE_AFTER_S
    return client, path


def leases(limiter: Limiter) -> int:
    return int(limiter.status()["leases_in_use"])


# --------------------------------------------------------------------------------------------
# breaker


def test_open_breaker_refuses_the_call_and_gives_its_grant_back(store, monkeypatch):
    # Given an open circuit, and a grant the runner booked for the call
    breaker = CircuitBreaker(store, CONFIG.name, threshold=1, cooldown_s=30)
    breaker.failure()
    limiter = Limiter(store, CONFIG.name, max_concurrent=1)
    (grant,) = limiter.reserve(1)
    client = FakeKind(CONFIG, ok())
    path = make_path(monkeypatch, client, limiter=limiter, breaker=breaker)
    # When the call is tried
    with pytest.raises(TransientError, match="circuit open"):
        path.call(BATCH, grant)
    # Then no call was made, and the grant's lease is free again
    assert client.calls == 0
    assert grant.released and leases(limiter) == 0


def test_open_breaker_lets_the_call_through_when_no_sibling_may_take_it(store, monkeypatch):
    # Given an open circuit on the route's last backend (may_refuse=False)
    breaker = CircuitBreaker(store, CONFIG.name, threshold=1, cooldown_s=30)
    breaker.failure()
    client = FakeKind(CONFIG, ok(0.5))
    path = make_path(monkeypatch, client, breaker=breaker, may_refuse=False)
    # When the call is made
    result = path.call(BATCH)
    # Then it went through, and its success closed the circuit's count
    assert client.calls == 1 and result.scores == [0.5]
    assert not store.exists(breaker.fails)


# --------------------------------------------------------------------------------------------
# limiter


def test_the_call_holds_a_lease_booked_here_and_gives_it_back_after_success(
        store, monkeypatch, registry):
    # Given a backend with one lease and no grant booked by the runner
    limiter = Limiter(store, CONFIG.name, max_concurrent=1)
    client = FakeKind(CONFIG, ok())
    client.look = lambda: leases(limiter)
    path = make_path(monkeypatch, client, limiter=limiter)
    # When the call is made
    path.call(BATCH)
    # Then it waited for its grant (counted), held the lease while in flight, and gave it
    # back after
    assert registry.get_sample_value("qrq_limiter_wait_seconds_count",
                                     {"backend": CONFIG.name}) == 1
    assert client.during == [1]
    assert leases(limiter) == 0


@pytest.mark.parametrize("failure", [PermanentError("bad verdict", status_code=400),
                                     RuntimeError("a bug in the kind"),
                                     KeyboardInterrupt()],
                         ids=["ScoringError", "not a ScoringError", "interrupt"])
def test_the_lease_goes_back_whatever_the_call_raises(store, monkeypatch, failure):
    # Given a call that raises
    limiter = Limiter(store, CONFIG.name, max_concurrent=1)
    client = FakeKind(CONFIG, failure)
    path = make_path(monkeypatch, client, limiter=limiter)
    # When it is made
    with pytest.raises(type(failure)):
        path.call(BATCH)
    # Then its lease is free again
    assert client.calls == 1
    assert leases(limiter) == 0


def test_a_call_the_limiter_cannot_start_gives_the_half_open_probe_back(store, monkeypatch):
    # Given a half-open circuit and a backend whose only lease another call holds
    monkeypatch.setattr(call_path, "MAX_LIMITER_WAIT_S", 0.05)
    breaker = CircuitBreaker(store, CONFIG.name)
    store.set(breaker.tripped, 1)
    limiter = Limiter(store, CONFIG.name, max_concurrent=1)
    (held,) = limiter.reserve(1)
    client = FakeKind(CONFIG, ok())
    path = make_path(monkeypatch, client, limiter=limiter, breaker=breaker)
    # When this call is tried (it takes the probe, then waits for a lease in vain)
    with pytest.raises(LimiterBusy):
        path.call(BATCH)
    # Then no call was made and the probe is free for the next caller
    assert client.calls == 0
    assert not store.exists(breaker.probe)
    assert breaker.allow()
    held.release(NO_FEEDBACK)


# --------------------------------------------------------------------------------------------
# clearance


def test_no_call_for_a_batch_nobody_waits_for(store, monkeypatch):
    # Given a batch whose caller cancelled it, and a grant the runner booked
    limiter = Limiter(store, CONFIG.name, max_concurrent=1)
    (grant,) = limiter.reserve(1)
    client = FakeKind(CONFIG, ok())
    path = make_path(monkeypatch, client, limiter=limiter,
                     stop="the batch was cancelled by its caller")
    # When the call is tried
    with pytest.raises(Cancelled, match="cancelled by its caller"):
        path.call(BATCH, grant)
    # Then no call was made and the lease is back
    assert client.calls == 0
    assert leases(limiter) == 0


def test_no_call_past_the_budget(store, monkeypatch):
    # Given a backend whose budget cannot hold the call's 5 tokens
    config = replace(CONFIG, budget=Budget(tokens_total=1))
    client = FakeKind(config, ok())
    path = make_path(monkeypatch, client, ledger=Ledger(store, config))
    # When the call is tried
    with pytest.raises(BudgetExceeded, match="tokens_total"):
        path.call(BATCH)
    # Then no call was made, and the path says the budget refused it
    assert client.calls == 0
    assert path.over_budget


def test_a_call_within_the_budget_is_made(store, monkeypatch):
    # Given a budget with room for the call
    config = replace(CONFIG, budget=Budget(tokens_total=1000))
    client = FakeKind(config, ok(usage=(4, 1)))
    path = make_path(monkeypatch, client, ledger=Ledger(store, config))
    # When it is made
    path.call(BATCH)
    # Then it went through and the budget is not marked as refusing
    assert client.calls == 1
    assert not path.over_budget


# --------------------------------------------------------------------------------------------
# transport: the result, its spend and metrics


def test_the_reply_its_usage_and_its_metrics_are_counted(store, monkeypatch, registry):
    # Given a backend answering 200 with its usage
    ledger = Ledger(store, CONFIG)
    client = FakeKind(CONFIG, ok(0.75, usage=(7, 3)))
    path = make_path(monkeypatch, client, ledger=ledger)
    latencies: list[float] = []
    path.observe = latencies.append
    # When the call is made
    result = path.call(BATCH)
    ledger.flush()
    # Then its scores come back, its tokens are spent for the backend and the batch, and the
    # request and its latency are counted
    assert result.scores == [0.75]
    spent = {"calls": 1, "tokens_in": 7, "tokens_out": 3, "estimated_calls": 0, "cost": 0.0}
    assert backend_spend(store, CONFIG)["total"] == spent
    assert batch_spend(store, BATCH_ID) == {CONFIG.name: spent}
    assert registry.get_sample_value("qrq_backend_requests_total",
                                     {"backend": CONFIG.name, "code": "200"}) == 1
    assert len(latencies) == 1


def test_a_2xx_reply_without_usage_spends_its_bound_marked_estimated(store, monkeypatch):
    # Given a backend answering 200 without usage
    ledger = Ledger(store, CONFIG)
    client = FakeKind(CONFIG, ok())
    path = make_path(monkeypatch, client, ledger=ledger)
    # When the call is made
    path.call(BATCH)
    ledger.flush()
    # Then it counts one token a byte read (5), marked estimated
    total = backend_spend(store, CONFIG)["total"]
    assert (total["calls"], total["tokens_in"], total["estimated_calls"]) == (1, 5, 1)


def test_a_failed_call_spends_nothing_counts_its_code_and_the_breaker_failure(
        store, monkeypatch, registry):
    # Given a backend answering 503
    ledger = Ledger(store, CONFIG)
    breaker = CircuitBreaker(store, CONFIG.name, threshold=5)
    client = FakeKind(CONFIG, TransientError("server error (503)", status_code=503))
    path = make_path(monkeypatch, client, ledger=ledger, breaker=breaker)
    # When the call is made
    with pytest.raises(TransientError, match="503"):
        path.call(BATCH)
    ledger.flush()
    # Then the call is counted with no tokens, its code in the metrics, one breaker failure
    total = backend_spend(store, CONFIG)["total"]
    assert (total["calls"], total["tokens_in"], total["tokens_out"]) == (1, 0, 0)
    assert registry.get_sample_value("qrq_backend_requests_total",
                                     {"backend": CONFIG.name, "code": "503"}) == 1
    assert store.get(breaker.fails) == b"1"


def test_a_timeout_is_counted_as_such(store, monkeypatch, registry):
    # Given a call that times out (no status)
    client = FakeKind(CONFIG, TransientError("timed out", timed_out=True))
    path = make_path(monkeypatch, client)
    # When it is made
    with pytest.raises(TransientError):
        path.call(BATCH)
    # Then the metrics say timeout
    assert registry.get_sample_value("qrq_backend_requests_total",
                                     {"backend": CONFIG.name, "code": "timeout"}) == 1


def test_a_429_is_no_breaker_failure(store, monkeypatch):
    # Given a breaker with one failure counted, and a backend answering 429
    breaker = CircuitBreaker(store, CONFIG.name, threshold=2)
    breaker.failure()
    client = FakeKind(CONFIG, rate_limited({}))
    path = make_path(monkeypatch, client, breaker=breaker)
    # When the call is made
    with pytest.raises(RateLimited):
        path.call(BATCH)
    # Then the backend counts as alive: the failure count is reset, the circuit closed
    assert not store.exists(breaker.fails)
    assert breaker.state() == "closed"


# --------------------------------------------------------------------------------------------
# what the limiter learns


@pytest.mark.parametrize(("headers", "flow_control"), [
    ({"x-ratelimit-remaining-requests": "90"}, True),  # congested: the concurrency is cut
    ({}, False),  # a bare 429: nothing the limiter can act on
])
def test_a_429_the_limiter_acts_on_becomes_flow_control(store, monkeypatch, headers,
                                                         flow_control):
    # Given a limited backend answering 429 with these headers
    limiter = Limiter(store, CONFIG.name, rpm=6000, max_concurrent=64)
    client = FakeKind(CONFIG, rate_limited(headers))
    path = make_path(monkeypatch, client, limiter=limiter)
    # When the call is made
    with pytest.raises(RateLimited) as raised:
        path.call(BATCH)
    # Then the error says whether the limiter paced it, and the caller keeps its own wait
    assert raised.value.flow_control is flow_control
    assert raised.value.retry_after_s == 1.0
    assert leases(limiter) == 0


def test_a_429_that_pauses_everyone_leaves_the_caller_no_wait_of_its_own(store, monkeypatch):
    # Given a backend answering 429 with a usable Retry-After
    limiter = Limiter(store, CONFIG.name, rpm=6000, max_concurrent=64)
    client = FakeKind(CONFIG, rate_limited({"retry-after": "1"}))
    path = make_path(monkeypatch, client, limiter=limiter)
    # When the call is made
    with pytest.raises(RateLimited) as raised:
        path.call(BATCH)
    # Then the limiter paused the backend for everyone, and the error waits no more itself
    assert raised.value.flow_control
    assert raised.value.retry_after_s == 0.0
    assert limiter.status()["paused_for_s"] > 0


# --------------------------------------------------------------------------------------------
# the async face and its hedge


def test_call_async_returns_the_reply_and_gives_the_lease_back(store, monkeypatch):
    # Given a limited backend and a grant the runner booked
    limiter = Limiter(store, CONFIG.name, max_concurrent=1)
    client = FakeKind(CONFIG, ok(0.25))
    client.look = lambda: leases(limiter)
    path = make_path(monkeypatch, client, limiter=limiter)

    async def run() -> Call:
        (grant,) = await limiter.reserve_async(1)
        result = await path.call_async(BATCH, grant)
        await limiter.flush_async()  # successes' finishes are sent together, a moment later
        return result

    # When the call is made on an event loop
    result = asyncio.run(run())
    # Then its reply comes back; it held the lease in flight and gave it back
    assert result.scores == [0.25]
    assert client.during == [1]
    assert leases(limiter) == 0


def test_a_slow_call_gets_a_hedge_whose_answer_wins(store, monkeypatch, registry):
    # Given a first call that hangs and a second that answers at once
    limiter = Limiter(store, CONFIG.name, max_concurrent=2)
    client, path = hedged(monkeypatch, Slow(None, ok(0.1)), ok(0.9), limiter=limiter)

    async def run() -> tuple[Call, int]:
        (grant,) = await limiter.reserve_async(1)
        result = await path.call_async(BATCH, grant)
        await limiter.flush_async()
        return result, client.cancelled  # before asyncio.run cancels what is left

    # When the call is made
    result, cancelled = asyncio.run(run())
    # Then the hedge's answer wins, the hung call is cancelled, both grants are back
    assert result.scores == [0.9]
    assert (client.calls, cancelled) == (2, 1)
    assert registry.get_sample_value("qrq_retries_total",
                                     {"backend": CONFIG.name, "reason": "hedge"}) == 1
    assert leases(limiter) == 0


def test_no_hedge_for_a_batch_nobody_waits_for_any_more(store, monkeypatch):
    # Given a slow call whose batch is cancelled while it is in flight
    client = FakeKind(CONFIG, Slow(0.1, ok(0.4)), ok(0.9))
    stops = iter([None])  # the first look (clearance) lets the call start; later ones stop
    path = make_path(monkeypatch, client)
    path.stop = lambda: next(stops, "the batch was cancelled by its caller")
    path.hedge_after_s = lambda: HEDGE_AFTER_S
    # When the call is made
    result = asyncio.run(path.call_async(BATCH, None))
    # Then no second call was made: the first one's answer is the call's
    assert result.scores == [0.4]
    assert client.calls == 1


def test_a_hedge_waits_its_turn_at_a_busy_limiter(store, monkeypatch):
    # Given a hung call, and the backend's other lease held by another call for 1.5 s (longer
    # than a hedge's shortest wait for its grant)
    limiter = Limiter(store, CONFIG.name, max_concurrent=2)
    client, path = hedged(monkeypatch, Slow(None, ok(0.1)), ok(0.9), limiter=limiter)

    async def run() -> Call:
        (other,) = await limiter.reserve_async(1)
        await other.wait_async()
        (grant,) = await limiter.reserve_async(1)

        async def other_ends() -> None:
            await asyncio.sleep(1.5)
            await other.release_async(NO_FEEDBACK)

        ending = asyncio.ensure_future(other_ends())
        result = await path.call_async(BATCH, grant)
        await ending
        await limiter.flush_async()
        return result

    # When the call is made
    result = asyncio.run(run())
    # Then the hedge waited for the lease (the call's timeout is far off) and its answer won
    assert result.scores == [0.9]
    assert client.calls == 2
    assert leases(limiter) == 0


def test_a_hedge_still_running_past_its_first_calls_timeout_is_dropped(store, monkeypatch):
    # Given a call that times out, and a hedge that hangs
    monkeypatch.setattr(call_path, "HEDGE_OVERRUN_S", 0.1)
    config = replace(CONFIG, timeout_s=0.05)
    timed_out = TransientError("no reply within 0.05 s", timed_out=True)
    client, path = hedged(monkeypatch, Slow(0.05, timed_out), Slow(None, ok(0.9)), config=config)

    async def run() -> tuple[ScoringError, int]:
        with pytest.raises(TransientError) as raised:
            await path.call_async(BATCH, None)
        await asyncio.sleep(0.01)  # the hedge's task takes its cancellation
        return raised.value, client.cancelled

    # When the call is made
    error, cancelled = asyncio.run(run())
    # Then the call ends with its own timeout once the overrun is past: the hedge is cancelled
    # (a handed-off straggler's task, coming back after it, never overlaps a call in flight)
    assert error is timed_out
    assert (client.calls, cancelled) == (2, 1)


def test_a_hedge_abandoned_while_it_waits_for_a_lease_leaves_none_behind(store, monkeypatch):
    # Given a slow call holding its backend's only lease, so that its hedge waits for one
    limiter = Limiter(store, CONFIG.name, max_concurrent=1)
    client, path = hedged(monkeypatch, Slow(0.2, ok(0.4)), ok(0.9), limiter=limiter)

    async def run() -> Call:
        (grant,) = await limiter.reserve_async(1)
        result = await path.call_async(BATCH, grant)
        await limiter.flush_async()
        for _ in range(200):  # the hedge's booking ends in its own time, then goes back
            if leases(limiter) == 0:
                break
            await asyncio.sleep(0.01)
        return result

    # When the call is made and answers while its hedge still waits
    result = asyncio.run(run())
    # Then the first answer is the call's, no second call was made, no lease is left behind
    assert result.scores == [0.4]
    assert client.calls == 1
    assert leases(limiter) == 0


def test_call_async_makes_no_call_for_a_batch_nobody_waits_for(store, monkeypatch):
    # Given a cancelled batch and a grant the runner booked on the loop
    limiter = Limiter(store, CONFIG.name, max_concurrent=1)
    client = FakeKind(CONFIG, ok())
    path = make_path(monkeypatch, client, limiter=limiter,
                     stop="the batch was cancelled by its caller")

    async def run() -> None:
        (grant,) = await limiter.reserve_async(1)
        await path.call_async(BATCH, grant)

    # When the call is tried
    with pytest.raises(Cancelled):
        asyncio.run(run())
    # Then no call was made and the lease is back
    assert client.calls == 0
    assert leases(limiter) == 0


def test_a_good_answer_wins_over_an_earlier_error(store, monkeypatch):
    # Given a slow first call that then fails, and a hedge that answers after that
    client = FakeKind(CONFIG, Slow(0.1, TransientError("server error (502)", status_code=502)),
                      Slow(0.2, ok(0.6)))
    path = make_path(monkeypatch, client)
    path.hedge_after_s = lambda: HEDGE_AFTER_S
    # When the call is made
    result = asyncio.run(path.call_async(BATCH, None))
    # Then the hedge's good answer is the call's, not the first one's error
    assert result.scores == [0.6]
    assert client.calls == 2


def test_with_both_calls_failing_the_first_ones_error_stands(store, monkeypatch):
    # Given two calls that both fail, the hedge differently
    client = FakeKind(CONFIG, Slow(0.05, TransientError("server error (502)", status_code=502)),
                      PermanentError("bad request (400)", status_code=400))
    path = make_path(monkeypatch, client)
    path.hedge_after_s = lambda: HEDGE_AFTER_S
    # When the call is made
    with pytest.raises(TransientError, match="502"):
        asyncio.run(path.call_async(BATCH, None))
    # Then both were made
    assert client.calls == 2


def test_a_reply_in_time_gets_no_hedge(store, monkeypatch):
    # Given a call that answers well before its hedge would start
    client = FakeKind(CONFIG, ok(0.3), ok(0.9))
    path = make_path(monkeypatch, client)
    path.hedge_after_s = lambda: 60.0
    # When the call is made
    result = asyncio.run(path.call_async(BATCH, None))
    # Then only one call was made
    assert result.scores == [0.3]
    assert client.calls == 1


@pytest.mark.parametrize("config", [replace(CONFIG, budget=Budget(tokens_total=10**9)),
                                    replace(CONFIG, retry=Retry(hedge=False))],
                         ids=["under a budget", "hedge = false"])
def test_no_hedge_under_a_budget_or_when_switched_off(store, monkeypatch, config):
    # Given a slow call on a backend that must not hedge
    client = FakeKind(config, Slow(0.05, ok(0.4)), ok(0.9))
    path = make_path(monkeypatch, client, ledger=Ledger(store, config))
    path.hedge_after_s = lambda: HEDGE_AFTER_S
    # When the call is made
    result = asyncio.run(path.call_async(BATCH, None))
    # Then the slow call's own answer is the call's, and no second call was made
    assert result.scores == [0.4]
    assert client.calls == 1
