"""One small interface for every kind of backend: split a chunk into calls, make one call."""

from __future__ import annotations

from ..config import Backend
from .base import BackendClient, Call
from .function import FunctionBackend
from .judge import JudgeBackend
from .reward_model import RewardModelBackend

KINDS: dict[str, type[BackendClient]] = {
    "judge": JudgeBackend,
    "reward_model": RewardModelBackend,
    "function": FunctionBackend,
}


def make_backend(config: Backend) -> BackendClient:
    return KINDS[config.kind](config)


__all__ = ["BackendClient", "Call", "make_backend"]
