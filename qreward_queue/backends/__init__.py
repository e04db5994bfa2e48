"""The kinds of backend, by the name `[backend] kind` gives them.

A kind is one class (see `base.BackendClient`) with its options dataclass (`Options`, read
from `[backend]` by its fields); KINDS is the one place a kind is added.
"""

from __future__ import annotations

from functools import cache

from ..config.model import Backend
from ..errors import ConfigError
from .base import BackendClient, Call
from .function import FunctionBackend, FunctionOptions
from .http import HttpOptions
from .judge import JudgeBackend, JudgeOptions
from .reward_model import RewardModelBackend, RewardModelOptions

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


__all__ = ["KINDS", "BackendClient", "Call", "FunctionOptions", "HttpOptions", "JudgeOptions",
           "RewardModelOptions", "make_backend"]
