"""A Python reward function named by import path, `fn(sample, **options) -> float`, per sample.

It runs in helper processes with per-sample limits (timeout, memory cap, recycling), in
`function_runner.py`, which only a call loads.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from typing import Any

from ..config.model import Backend
from ..config.toml_table import Table
from .base import BackendClient, Call


def _time_needed_s(function: str, options: dict) -> tuple[float, str] | None:
    """What a built-in reward says one sample may take with these options (code_reward:
    its sandbox's own bound), None when it says nothing. Only qrq's own rewards are imported
    here: a user's module stays unimported until a call."""
    module, _, name = function.partition(":")
    if not module.startswith("qreward_queue.rewards."):
        return None
    with contextlib.suppress(ImportError, AttributeError, TypeError, ValueError):
        return getattr(importlib.import_module(module), name).time_needed_s(**options)
    return None


class FunctionBackend(BackendClient):
    """Scores a whole chunk in one call: the queue overhead is paid per chunk, not per sample."""

    runs_locally = True
    default_chunk_size = 16

    @classmethod
    def read_options(cls, b: Table) -> dict[str, Any]:
        function = b.get(
            "function", str, required=True, expected="an import path 'package.module:callable'"
        )
        if not re.fullmatch(r"[\w.]+:[\w.]+", function):
            raise b.fail("function", "an import path 'package.module:callable'")
        options = b.get("options", dict, {}, expected="a table of keyword arguments")
        needed = _time_needed_s(function, options)
        if needed is not None and b.number("timeout_s", Backend.timeout_s) < needed[0]:
            raise b.fail("timeout_s", f"at least {needed[0]:g} s per sample ({needed[1]})")
        return {"function": function, "options": options}

    @property
    def samples_per_call(self) -> int:
        return max(1, self.config.chunk_size or 1)

    def call(self, samples: list[dict]) -> Call:
        from .function_runner import load_function, runner

        load_function(self.config.function)  # a bad path fails the call here, before any fork
        results = runner(self.config).score(samples)
        scores = [r[0] if isinstance(r, tuple) else r for r in results]
        return Call(scores, details=[r[1] if isinstance(r, tuple) else None for r in results])
