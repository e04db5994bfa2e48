"""The process-wide app a trainer's calls go through, built once from the configuration."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from ..broker.app import QrqCelery
from ..config.loader import load_config
from ..config.model import Config

if TYPE_CHECKING:
    from ..worker.boot import EmbeddedWorker

_lock = threading.Lock()
_app: QrqCelery | None = None
_worker: EmbeddedWorker | None = None
MAX_EMBEDDED_THREADS = 256


def configure(config: Config | str | os.PathLike[str] | None = None) -> QrqCelery:
    """Build the app for `config` (a Config, a path, or None for the default lookup).

    In embedded mode this also starts the in-process worker threads.
    """
    global _app, _worker
    if not isinstance(config, Config):
        config = load_config(Path(config) if config else None)
    shutdown()
    with _lock:
        _app = QrqCelery(config)
        if config.embedded and config.backends:
            from ..worker.boot import EmbeddedWorker  # the worker side, in this process

            threads = sum(b.pool.concurrency for b in config.backends.values())
            _worker = EmbeddedWorker(_app, min(threads, MAX_EMBEDDED_THREADS))
        return _app


def shutdown() -> None:
    """Stop the embedded worker threads, if any run (the app stays usable for status)."""
    global _worker
    with _lock:
        if _worker is not None:
            _worker.stop()
            _worker = None


def get_app() -> QrqCelery:
    """The configured app, built from the default configuration on first use."""
    return _app if _app is not None else configure()
