"""The kinds of backend, by the name `[backend] kind` gives them.

A kind is one class (see `base.BackendClient`); KINDS is the one place a kind is added.
"""

from __future__ import annotations

from functools import cache

from ..config.model import Backend
from ..errors import ConfigError
from .base import BackendClient, Call
from .function import FunctionBackend
from .judge import JudgeBackend
from .reward_model import RewardModelBackend

KINDS: dict[str, type[BackendClient]] = {
    "judge": JudgeBackend,
    "reward_model": RewardModelBackend,
    "function": FunctionBackend,
}


@cache
def make_backend(config: Backend) -> BackendClient:
    """The client of `config`'s kind for it (one per distinct backend setting)."""
    kind = KINDS.get(config.kind)
    if kind is None:  # a Backend made in Python: the loader refuses such a file itself
        raise ConfigError(f"{config.source}: backend {config.name!r}: unknown kind "
                          f"{config.kind!r} (known: {', '.join(KINDS)})")
    return kind(config)


__all__ = ["KINDS", "BackendClient", "Call", "make_backend"]
