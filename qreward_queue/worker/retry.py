"""Retry and backoff, in one place: a backend's `[retry]` settings as a `RetryPolicy`.

Two clocks of retry, one policy. A 429 and a fault (a 5xx, a lost connection, a timeout)
are tried again inside their call, after their wait (`RetryPolicy.wait_after_429`,
`RetryPolicy.wait_after_fault`, counted per call by `Tries`); whatever else is left after a
chunk's run (a call out of attempts, a long limiter wait, an open circuit) goes to
`RetryPolicy.decide`: back off and run the task again, fail over onto a sibling backend's
queue, or give up with explicit outcomes. Both back off by `RetryPolicy.backoff_s`.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Literal

from ..config.model import Retry
from ..errors import CircuitOpen, RateLimited, ScoringError, TransientError

RETURN_MARGIN_S = 0.5  # a chunk returns what it has this long before the batch deadline
IN_RUN_BACKOFF_S = 2.0  # a fault whose backoff may be longer is retried by the task, whose
# slot serves other work meanwhile (a backend that is down must not hold the worker)


def time_left_s(deadline: float | None) -> float | None:
    """Seconds a task may still work on its batch (None: no deadline); it stops
    RETURN_MARGIN_S early so that its result reaches the client by the deadline."""
    return None if deadline is None else max(0.0, deadline - RETURN_MARGIN_S - time.time())


@dataclass(frozen=True)
class Next:
    """What `score_chunk` does with the samples left after a run."""

    action: Literal["done", "wait", "retry", "failover", "give_up"]
    countdown: float = 0.0
    why: str = ""


class Tries:
    """One call's attempts: `spent` of the sample's `[retry] attempts` since the task began
    (it began at `first`), and the flow-control 429s met in a row since the last one spent."""

    def __init__(self, first: int):
        self.first, self.spent, self.paced = first, 0, 0

    @property
    def attempt(self) -> int:
        """The sample's attempts so far (what its outcome reports)."""
        return self.first + self.spent


@dataclass(frozen=True)
class RetryPolicy:
    """A backend's `[retry]` settings put to work; pure apart from the jitter."""

    config: Retry

    def backoff_s(self, attempt: int) -> float:
        """Exponential backoff with full jitter: uniform in [0, `longest_backoff_s`]."""
        delay = self.longest_backoff_s(attempt)
        return random.uniform(0, delay) if self.config.jitter else delay

    def longest_backoff_s(self, attempt: int) -> float:
        """min(cap, base * 2**(attempt-1))."""
        c = self.config
        return min(c.backoff_cap_s, c.backoff_base_s * 2 ** (attempt - 1))

    def wait_after_429(self, exc: RateLimited, tries: Tries, time_left: float | None
                       ) -> float | None:
        """How long a 429'd call waits before it is made again (None: no more tries here).

        A 429 the limiter turned into flow control (`exc.flow_control`) spends an attempt
        only every `rate_limited_per_attempt` in a row; any other spends one. The wait is
        the reply's Retry-After (0 when the limiter paused everyone for it), else the backoff.
        """
        tries.paced += 1
        if not exc.flow_control or tries.paced > self.config.rate_limited_per_attempt:
            tries.spent, tries.paced = tries.spent + 1, 0
        wait_s = exc.retry_after_s
        if wait_s is None:
            wait_s = self.backoff_s(tries.attempt + tries.paced - 1)
        if tries.attempt < self.config.attempts and (time_left is None or wait_s < time_left):
            return wait_s
        return None

    def wait_after_fault(self, exc: ScoringError, tries: Tries, time_left: float | None
                         ) -> float | None:
        """How long a call that failed transiently (a 5xx, a lost connection, a timeout)
        waits before it is made again in its run (None: not here, `decide` takes it).

        A fault that does not depend on load is paid by its own call: its samples are tried
        again after the backoff while the rest of the chunk goes on, instead of waiting for
        the chunk's run to end and the task to come back. Each try spends an attempt; an
        open circuit (a sibling backend may take the work) and a backoff that may pass
        IN_RUN_BACKOFF_S are left to `decide`.
        """
        if not isinstance(exc, TransientError) or isinstance(exc, CircuitOpen) or (
                self.longest_backoff_s(tries.attempt) > IN_RUN_BACKOFF_S):
            return None
        wait_s = self.backoff_s(tries.attempt)
        if tries.attempt < self.config.attempts and (time_left is None or wait_s < time_left):
            tries.spent += 1
            return wait_s
        return None

    def decide(self, left: int, attempt: int, time_left: float | None, busy_s: float | None,
               has_siblings: bool, circuit_open: bool) -> Next:
        """The retry/failover decision for the `left` samples of a run: pure, so every
        branch is unit-tested on its own.

        `time_left`: seconds until the task must return (None: no deadline); a wait or backoff
        that would end after it gives up instead, so finished samples are never held back.

        >>> RetryPolicy(Retry()).decide(0, 1, 10.0, None, False, False).action
        'done'
        >>> RetryPolicy(Retry(attempts=4)).decide(3, 4, 10.0, None, True, False).action
        'failover'
        """
        def fits(seconds: float) -> bool:
            return time_left is None or seconds < time_left

        attempts = self.config.attempts
        if left == 0:
            return Next("done")
        if not fits(0.0):
            return Next("give_up", why="the batch deadline passed")
        if busy_s is not None:  # a long limiter wait: free the slot meanwhile
            return Next("wait", busy_s) if fits(busy_s) else Next(
                "give_up", why=f"the limiter's wait ({busy_s:.1f} s) ends after the batch deadline"
            )
        if attempt < attempts and not (has_siblings and circuit_open):
            backoff = self.backoff_s(attempt)
            if fits(backoff):
                return Next("retry", backoff)
        if has_siblings:
            return Next("failover")
        if attempt < attempts:
            return Next("give_up", why="the batch deadline passed")
        return Next("give_up", why="no sibling backend left")
