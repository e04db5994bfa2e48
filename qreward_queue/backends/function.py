"""A Python reward function named by import path, `fn(sample, **options) -> float`, per sample.

It runs in helper processes with per-sample limits (timeout, memory cap, recycling), in
`function_runner.py`, which only a call loads.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..config.model import Backend, KindOptions
from ..config.toml_table import Table, read_fields
from ..errors import ConfigError
from .base import BackendClient, Call


@dataclass(frozen=True, kw_only=True)
class FunctionOptions(KindOptions):
    """A function backend's own keys of `[backend]`."""

    function: str = field(metadata={"expected": "an import path 'package.module:callable'"})
    # the function's keyword arguments, fn(sample, **options) (`[backend.options]`)
    options: dict[str, Any] = field(default_factory=dict, hash=False,
                                    metadata={"expected": "a table of keyword arguments"})


def builtin_hook(function: str, hook: str) -> Callable[..., Any] | None:
    """What a built-in reward says of itself (its `time_needed_s`, `preflight`), None when it
    says nothing. Only qrq's own rewards are imported here: a user's module stays unimported
    until a call."""
    module, _, name = function.partition(":")
    if not module.startswith("qreward_queue.rewards."):
        return None
    with contextlib.suppress(ImportError, AttributeError):
        found = getattr(getattr(importlib.import_module(module), name), hook)
        return found if callable(found) else None
    return None


def _time_needed_s(function: str, options: dict) -> tuple[float, str] | None:
    """What a built-in reward says one sample may take with these options (code_reward:
    its sandbox's own bound), None when it says nothing."""
    hook = builtin_hook(function, "time_needed_s")
    with contextlib.suppress(TypeError, ValueError):
        return hook(**options) if hook else None
    return None


class FunctionBackend(BackendClient):
    """Scores a whole chunk in one call: the queue overhead is paid per chunk, not per sample."""

    runs_locally = True
    default_chunk_size = 16
    Options: ClassVar[type[KindOptions]] = FunctionOptions

    def __init__(self, config: Backend):
        super().__init__(config)
        self.options = config.options_as(FunctionOptions)

    @classmethod
    def read_options(cls, b: Table) -> KindOptions:
        options = read_fields(b, FunctionOptions)
        if not re.fullmatch(r"[\w.]+:[\w.]+", options.function):
            raise b.fail("function", "an import path 'package.module:callable'")
        needed = _time_needed_s(options.function, options.options)
        if needed is not None and b.number("timeout_s", Backend.timeout_s) < needed[0]:
            raise b.fail("timeout_s", f"at least {needed[0]:g} s per sample ({needed[1]})")
        return options

    def preflight(self) -> list[str]:
        """A built-in reward's own check (code_reward: which sandbox runs its programs, or
        the reason none can here)."""
        notes = super().preflight()
        hook = builtin_hook(self.options.function, "preflight")
        if hook is not None:
            try:
                notes += hook(**self.options.options)
            except Exception as exc:  # the reward's reason it cannot run in this process
                raise ConfigError(f"{self.config.source}: {exc}") from None
        return notes

    def identity(self) -> list[Any]:
        return [*super().identity(), self.options.function, self.options.options]

    @property
    def samples_per_call(self) -> int:
        return max(1, self.config.chunk_size or 1)

    def call(self, samples: list[dict]) -> Call:
        from .function_runner import load_function, runner

        load_function(self.options.function)  # a bad path fails the call here, before any fork
        results = runner(self.config).score(samples)
        scores = [r[0] if isinstance(r, tuple) else r for r in results]
        return Call(scores, details=[r[1] if isinstance(r, tuple) else None for r in results])
