"""Shared by the examples: a mock judge and qrq configured for it, in one process.

The examples run embedded (no Redis) so they work anywhere, also with QRQ_REDIS_URL exported
(they say so and ignore it: their judge and workers live in this process); QRQ_ALLOW_EMBEDDED=1
says that this really is one process. In training, set QRQ_REDIS_URL and QRQ_CONFIG instead and
run `qrq worker` pools: the integrations refuse embedded mode under multi-process trainers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import qreward_queue as qrq
from qreward_queue.config.extras import require
from qreward_queue.errors import ConfigError
from qreward_queue.testing.mock_judge import MockJudge, MockJudgeSettings


def needs(module: str) -> ModuleType:
    """Import what this example needs beyond qrq, or exit with one line naming the extra."""
    try:
        return require(module, f"examples/{Path(sys.argv[0]).name}")
    except ConfigError as exc:
        sys.exit(f"qrq: error: {exc}")


@contextlib.contextmanager
def mock_stack() -> Iterator[Path]:
    """A mock judge (600 rpm, 8 concurrent, 20 ms) behind route "judge"; yields qrq.toml."""
    os.environ.setdefault("QRQ_ALLOW_EMBEDDED", "1")
    if os.environ.get("QRQ_REDIS_URL"):
        print(f"{Path(sys.argv[0]).name}: runs embedded with its own mock judge "
              "(QRQ_REDIS_URL is ignored here)", file=sys.stderr)
    with MockJudge(MockJudgeSettings(rpm=600, max_concurrent=8, latency_ms=20)) as judge, \
            tempfile.TemporaryDirectory(prefix="qrq-example-") as tmp:
        workers = Path(tmp) / "workers"
        workers.mkdir()
        (workers / "judge.toml").write_text(
            f'[backend]\nkind = "judge"\nurl = "{judge.url}/v1"\nmodel = "mock"\n'
            "[limits]\nrpm = 600\nmax_concurrent = 8\n[pool]\nconcurrency = 8\n")
        config = workers.parent / "qrq.toml"
        config.write_text('[defaults]\nroute = "judge"\n')
        qrq.configure(dataclasses.replace(qrq.load_config(config), redis_url=None))
        try:
            yield config
        finally:
            from qreward_queue.trainer.runtime import shutdown

            shutdown()
