"""Optional dependencies: which extra brings each, and one clear line when it is missing.

    >>> web = require("aiohttp.web", "qrq gateway")  # else ConfigError("qrq gateway: aiohttp
    ... # is not installed: pip install 'qreward-queue[gateway]'")
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import ConfigError

EXTRAS = {  # top-level module -> the extra of pyproject.toml that installs it
    "aiohttp": "gateway",
    "prometheus_client": "metrics",
    "requests": "metrics",  # `qrq plan --metrics-url`
    "flower": "monitor",
    "math_verify": "rewards",
    "numpy": "examples",
}


def install_hint(module: str) -> str | None:
    """`pip install 'qreward-queue[EXTRA]'` for an optional module, None for any other."""
    extra = EXTRAS.get(module.partition(".")[0])
    return f"pip install 'qreward-queue[{extra}]'" if extra else None


def missing_extra(exc: ImportError, purpose: str) -> str | None:
    """The one line for an ImportError of an optional module; None when it is another module
    (a real bug, whose traceback must show)."""
    name = exc.name or ""
    hint = install_hint(name)
    return f"{purpose}: {name.partition('.')[0]} is not installed: {hint}" if hint else None


def require(module: str, purpose: str) -> ModuleType:
    """Import an optional `module`, or raise a ConfigError naming the extra that brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        line = missing_extra(exc, purpose)
        if line is None:
            raise
        raise ConfigError(line) from None
