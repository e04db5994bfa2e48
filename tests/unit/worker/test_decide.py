"""The retry/failover decision of score_chunk, a pure function: every branch on its own."""

from __future__ import annotations

import pytest

from qreward_queue.config.model import Retry
from qreward_queue.errors import CircuitOpen, PermanentError, RateLimited, TransientError
from qreward_queue.worker.retry import Next, RetryPolicy, Tries

POLICY = Retry(attempts=3, backoff_base_s=0.5, backoff_cap_s=10, jitter=False)


def choose(left=2, attempt=1, time_left=60.0, busy_s=None, siblings=False, circuit_open=False):
    return RetryPolicy(POLICY).decide(left, attempt, time_left, busy_s, siblings, circuit_open)


def test_nothing_left_is_done_whatever_else_holds():
    assert choose(left=0, time_left=0.0, busy_s=5.0) == Next("done")


def test_a_passed_deadline_gives_up_before_anything_else():
    nxt = choose(time_left=0.0, busy_s=5.0, siblings=True)
    assert (nxt.action, nxt.why) == ("give_up", "the batch deadline passed")


def test_a_long_limiter_wait_frees_the_slot_for_that_long():
    assert choose(busy_s=4.5, attempt=3) == Next("wait", 4.5)


@pytest.mark.parametrize(("attempt", "countdown"), [(1, 0.5), (2, 1.0)])
def test_retries_here_with_exponential_backoff_while_attempts_remain(attempt, countdown):
    assert choose(attempt=attempt) == Next("retry", countdown)


def test_an_open_circuit_skips_the_retries_when_a_sibling_can_take_over():
    assert choose(attempt=1, siblings=True, circuit_open=True).action == "failover"
    # without a sibling the open circuit does not stop the retries here
    assert choose(attempt=1, circuit_open=True).action == "retry"


def test_out_of_attempts_fails_over_or_gives_up():
    assert choose(attempt=3, siblings=True).action == "failover"
    nxt = choose(attempt=3)
    assert (nxt.action, nxt.why) == ("give_up", "no sibling backend left")


def test_no_deadline_means_every_wait_fits():
    assert choose(time_left=None, busy_s=1e6) == Next("wait", 1e6)


def test_a_wait_or_backoff_ending_after_the_deadline_gives_up_now():
    nxt = choose(time_left=3.0, busy_s=4.5)
    assert (nxt.action, "limiter") == ("give_up", "limiter") and "4.5 s" in nxt.why
    assert choose(time_left=0.2, attempt=2).action == "give_up"  # backoff 1.0 s > 0.2 s
    assert choose(time_left=0.2, attempt=2, siblings=True).action == "failover"


def throttled(flow_control: bool, retry_after_s: float | None = 0.1) -> RateLimited:
    exc = RateLimited("rate limited (429)", status_code=429, retry_after_s=retry_after_s)
    exc.flow_control = flow_control
    return exc


def test_a_429_that_is_not_flow_control_spends_an_attempt_each():
    policy, tries = RetryPolicy(POLICY), Tries(1)
    waits = [policy.wait_after_429(throttled(False, None), tries, 60.0) for _ in range(2)]
    assert waits == [0.5, None] and tries.attempt == 3  # backoff 0.5 s, then attempts spent


def test_flow_control_429s_spend_one_attempt_per_rate_limited_per_attempt_in_a_row():
    policy, tries = RetryPolicy(Retry(attempts=2, rate_limited_per_attempt=3)), Tries(1)
    waits = [policy.wait_after_429(throttled(True), tries, 60.0) for _ in range(4)]
    assert waits == [0.1, 0.1, 0.1, None] and tries.attempt == 2


def test_a_429_wait_past_the_deadline_is_not_waited():
    assert RetryPolicy(POLICY).wait_after_429(throttled(True, 5.0), Tries(1), 4.0) is None


def test_a_fault_is_tried_again_in_its_run_after_the_backoff_while_attempts_remain():
    policy, tries = RetryPolicy(POLICY), Tries(1)
    fault = TransientError("server error 500 from judge", status_code=500)
    waits = [policy.wait_after_fault(fault, tries, 60.0) for _ in range(3)]
    assert waits == [0.5, 1.0, None] and tries.attempt == 3  # attempts = 3: then decide's


def test_a_fault_from_a_later_task_attempt_has_fewer_tries_left_in_its_run():
    tries = Tries(2)
    fault = TransientError("no reply within 10 s", timed_out=True)
    assert RetryPolicy(POLICY).wait_after_fault(fault, tries, 60.0) == 1.0
    assert tries.attempt == 3


def test_an_open_circuit_a_permanent_error_or_a_429_is_not_a_fault_to_try_again_here():
    policy = RetryPolicy(POLICY)
    for error in (CircuitOpen("circuit open: backend 'j' is cooling down"),
                  PermanentError("client error 400"), throttled(False)):
        tries = Tries(1)
        assert policy.wait_after_fault(error, tries, 60.0) is None and tries.attempt == 1


def test_a_fault_whose_backoff_ends_after_the_deadline_is_left_to_decide():
    tries = Tries(1)
    assert RetryPolicy(POLICY).wait_after_fault(TransientError("500"), tries, 0.4) is None
    assert tries.attempt == 1


def test_a_fault_whose_backoff_may_be_long_is_left_to_the_tasks_retry():
    # attempts 1, 2, 3 may wait up to 0.5, 1, 2 s: in the run; the fourth up to 4 s: not
    policy, tries = RetryPolicy(Retry(attempts=6, backoff_base_s=0.5, jitter=True)), Tries(1)
    waits = [policy.wait_after_fault(TransientError("500"), tries, 60.0) for _ in range(4)]
    assert all(0 <= w <= 2.0 for w in waits[:3]) and waits[3] is None and tries.attempt == 4
    slow = RetryPolicy(Retry(attempts=3, backoff_base_s=30, jitter=False))
    assert slow.wait_after_fault(TransientError("500"), Tries(1), 600.0) is None
