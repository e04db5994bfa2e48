"""Shared by the examples: a mock judge and qrq configured for it, in one process.

The examples run embedded (no Redis) so they work anywhere; QRQ_ALLOW_EMBEDDED=1 says that
this really is one process. In training, set QRQ_REDIS_URL and QRQ_CONFIG instead and run
`qrq worker` pools: the integrations refuse embedded mode under multi-process trainers.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import qreward_queue as qrq
from qreward_queue.mock_judge import MockJudge, MockJudgeSettings


@contextlib.contextmanager
def mock_stack() -> Iterator[Path]:
    """A mock judge (600 rpm, 8 concurrent, 20 ms) behind route "judge"; yields qrq.toml."""
    os.environ.setdefault("QRQ_ALLOW_EMBEDDED", "1")
    with MockJudge(MockJudgeSettings(rpm=600, max_concurrent=8, latency_ms=20)) as judge:
        workers = Path(tempfile.mkdtemp()) / "workers"
        workers.mkdir()
        (workers / "judge.toml").write_text(
            f'[backend]\nkind = "judge"\nurl = "{judge.url}/v1"\nmodel = "mock"\n'
            "[limits]\nrpm = 600\nmax_concurrent = 8\n[pool]\nconcurrency = 8\n")
        config = workers.parent / "qrq.toml"
        config.write_text('[defaults]\nroute = "judge"\n')
        qrq.configure(config)
        try:
            yield config
        finally:
            from qreward_queue.runtime import shutdown

            shutdown()
