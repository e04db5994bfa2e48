"""The process's limiters, breakers and ledgers: one of each per backend, built on first use
from its configuration and shared by every call in the process (the Celery app only holds the
registry, so a trainer that never calls a backend builds none)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import redis

from .breaker import CircuitBreaker
from .limiter import Limiter
from .spend import Ledger

if TYPE_CHECKING:  # flow sits below the configuration: it is handed its config
    from ..config.model import Config

EMBEDDED_FINISH_DELAY_S = 0.01  # in-process Lua costs interpreter time: successes end together


class FlowRegistry:
    """Backend name -> its Limiter (None when its file sets no limits), CircuitBreaker, Ledger."""

    def __init__(self, config: Config, store: Callable[[], redis.Redis],
                 connect_async: Callable[[], redis.asyncio.Redis] | None):
        self.config = config
        self._store = store  # called on first use: the app's store connects lazily
        self._connect_async = connect_async
        self._limiters: dict[str, Limiter | None] = {}
        self._breakers: dict[str, CircuitBreaker] = {}
        self._ledgers: dict[str, Ledger] = {}

    def limiter(self, name: str) -> Limiter | None:
        """The global limiter of backend `name` (None when its file sets no limits)."""
        if name not in self._limiters:
            backend = self.config.backend(name)
            limits = backend.limits
            self._limiters[name] = (
                None
                if not (limits.rpm or limits.tpm or limits.max_concurrent)
                else Limiter(
                    self._store(),
                    name,
                    rpm=limits.rpm,
                    tpm=limits.tpm,
                    max_concurrent=limits.max_concurrent,
                    burst_s=limits.burst_s,
                    lease_ttl_s=backend.timeout_s + 10.0,
                    max_pause_s=limits.max_pause_s,
                    finish_delay_s=EMBEDDED_FINISH_DELAY_S if self.config.embedded else 0.0,
                    connect_async=self._connect_async,
                )
            )
        return self._limiters[name]

    def breaker(self, name: str) -> CircuitBreaker:
        """The circuit breaker of backend `name`, shared by every process through the store."""
        if name not in self._breakers:
            retry = self.config.backend(name).retry
            self._breakers[name] = CircuitBreaker(
                self._store(), name, retry.breaker_threshold, retry.breaker_cooldown_s
            )
        return self._breakers[name]

    def ledger(self, name: str) -> Ledger:
        """Backend `name`'s spend and budget, as this process's calls add to them."""
        if name not in self._ledgers:
            self._ledgers[name] = Ledger(self._store(), self.config.backend(name))
        return self._ledgers[name]
