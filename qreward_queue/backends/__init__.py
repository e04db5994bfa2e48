"""The kinds of backend, by the name `[backend] kind` gives them.

A kind is one class (see `base.BackendClient`); KINDS is the one place a kind is added.
"""

from __future__ import annotations

from functools import cache

from ..settings import Backend
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
    return KINDS[config.kind](config)


__all__ = ["KINDS", "BackendClient", "Call", "make_backend"]
