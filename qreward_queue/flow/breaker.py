"""A circuit breaker per backend, shared in Redis by every worker and client.

Closed: calls go through. After `threshold` failures in a row (timeouts, connection errors,
5xx; every success resets the count) it opens for `cooldown_s`: the route's other backends
get the work. When the cooldown ends it is half-open: exactly one caller gets to probe; a
success closes it, a failure opens it again. Expiring keys keep time, so no clock is read.

Keys (`keys.breaker`): `fails` consecutive failures (expires after a minute without one),
`open` exists while open (PX cooldown), `tripped` from the first opening until a success,
`probe` the one half-open probe in flight.
"""

from __future__ import annotations

import time

import redis

from .. import keys

CLEAN_CACHE_S = 0.5


class CircuitBreaker:
    """Example:
    >>> import fakeredis
    >>> breaker = CircuitBreaker(fakeredis.FakeRedis(), "judge-a", threshold=2, cooldown_s=30)
    >>> breaker.failure(); breaker.failure(); breaker.allow()
    False
    """

    def __init__(self, store: redis.Redis, backend: str, threshold: int = 5,
                 cooldown_s: float = 30.0, probe_ttl_s: float = 60.0):
        self.store, self.threshold = store, threshold
        self.cooldown_ms, self.probe_ttl_ms = int(cooldown_s * 1000), int(probe_ttl_s * 1000)
        names = keys.breaker(backend)
        self.fails, self.open_key = names["fails"], names["open"]
        self.tripped, self.probe = names["tripped"], names["probe"]
        self._dirty = True  # until allow() has looked, assume there may be state to clear
        self._clean_until = 0.0  # monotonic time until which a clean, closed state is trusted

    def is_open(self) -> bool:
        """True while the backend should get no new work (cooling down)."""
        return bool(self.store.exists(self.open_key))

    def state(self) -> str:
        """closed, half-open (tripped, cooldown over, waiting for a probe's success) or open."""
        is_open, tripped = self.store.mget(self.open_key, self.tripped)
        return "open" if is_open else "half-open" if tripped else "closed"

    def allow(self) -> bool:
        """May this caller use the backend now? In half-open state only the one prober may.

        A clean, closed state (no failure anywhere) is trusted for CLEAN_CACHE_S without a
        round trip: a failure seen by another process is noticed that much later at most.
        """
        now = time.monotonic()
        if now < self._clean_until:
            return True
        is_open, tripped, fails = self.store.mget(self.open_key, self.tripped, self.fails)
        self._dirty = self._dirty or bool(tripped or fails)
        if not (is_open or tripped or fails):
            self._clean_until = now + CLEAN_CACHE_S
        if is_open:
            return False
        if tripped:
            return bool(self.store.set(self.probe, 1, nx=True, px=self.probe_ttl_ms))
        return True

    def release_probe(self) -> None:
        """Give the half-open probe back when the granted call did not happen."""
        self.store.delete(self.probe)

    def success(self) -> None:
        """Reset the failure count; skipped (no round trip) while nothing was seen to reset."""
        if self._dirty:
            self._dirty = False
            self.store.delete(self.fails, self.tripped, self.probe)

    def failure(self) -> None:
        self._dirty, self._clean_until = True, 0.0
        with self.store.pipeline() as pipe:
            pipe.incr(self.fails)
            pipe.expire(self.fails, 60)
            pipe.exists(self.tripped)
            count, _, tripped = pipe.execute()
        if count >= self.threshold or tripped:
            with self.store.pipeline() as pipe:
                pipe.set(self.open_key, 1, px=self.cooldown_ms)
                pipe.set(self.tripped, 1, ex=3600)
                pipe.delete(self.fails, self.probe)
                pipe.execute()
