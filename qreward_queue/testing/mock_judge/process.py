"""The mock judge in its own process (spawn(), MockJudgeProcess) and the `qrq mock-judge`
command that process runs: apart, so a benchmark's judge has its own GIL and CPU time."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from dataclasses import fields
from pathlib import Path
from typing import Any

import click

from .server import MockJudge
from .settings import GROUP_REPLIES, MockJudgeSettings


class MockJudgeProcess:
    """The mock judge in a subprocess, so it has its own GIL and CPU time; see spawn()."""

    def __init__(self, process: subprocess.Popen[str], url: str) -> None:
        self.process = process
        self.url = url

    def stats(self) -> dict[str, int]:
        with urllib.request.urlopen(f"{self.url}/stats", timeout=10) as response:
            return json.load(response)

    def reset(self) -> None:
        """Zero the counters, e.g. between two runs against the same server."""
        self._post("/stats/reset", b"")

    def hold(self, answer: int = 0) -> None:
        """Answer `answer` more calls, then hold every reply until `release()`."""
        self._post("/hold", json.dumps({"answer": answer}).encode())

    def release(self) -> None:
        self._post("/release", b"")

    def _post(self, path: str, body: bytes) -> None:
        request = urllib.request.Request(f"{self.url}{path}", data=body, method="POST")
        urllib.request.urlopen(request, timeout=10).close()

    def kill(self) -> None:
        """SIGKILL, as a crash would: for failover tests."""
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.process.stdout:
            self.process.stdout.close()

    def __enter__(self) -> MockJudgeProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def spawn(settings: MockJudgeSettings | None = None, timeout_s: float = 10.0) -> MockJudgeProcess:
    """Run the mock judge as `python -m qreward_queue.testing.mock_judge` and wait for its URL."""
    settings = settings or MockJudgeSettings()
    options = []
    for field in fields(settings):
        name, value = field.name.replace("_", "-"), getattr(settings, field.name)
        options += [f"--{name}" if value else f"--no-{name}"] if isinstance(value, bool) \
            else [f"--{name}", str(value)]
    # make the package importable whatever the caller's working directory is
    paths = [str(Path(__file__).absolute().parents[3]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    process = subprocess.Popen(
        [sys.executable, "-m", "qreward_queue.testing.mock_judge", *options],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    stdout = process.stdout
    assert stdout is not None
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=timeout_s)
    except queue.Empty:
        line = None
    match = re.search(r"listening on (https?://\S+)", line or "")
    if match:
        return MockJudgeProcess(process, match.group(1))
    process.kill()
    process.wait()
    if line is None:
        raise RuntimeError(f"mock judge did not print its URL within {timeout_s:g} s")
    if not line:
        raise RuntimeError(f"mock judge exited with code {process.returncode} before starting")
    raise RuntimeError(f"mock judge printed {line.strip()!r} instead of its URL")


_DEFAULTS = MockJudgeSettings()


@click.command("mock-judge")
@click.option("--host", default=_DEFAULTS.host, show_default=True, help="Interface to bind.")
@click.option("--port", default=_DEFAULTS.port, show_default=True, help="0 picks a free port.")
@click.option("--rpm", type=float, default=_DEFAULTS.rpm, help="Requests/min, 0 = no limit.")
@click.option("--tpm", type=float, default=_DEFAULTS.tpm, help="Tokens/min, 0 = no limit.")
@click.option(
    "--max-concurrent", default=_DEFAULTS.max_concurrent, help="Requests in flight, 0 = no limit."
)
@click.option("--latency-ms", type=float, default=_DEFAULTS.latency_ms, show_default=True,
              help="Mean latency.")
@click.option("--latency-cv", type=float, default=_DEFAULTS.latency_cv, show_default=True,
              help="Coefficient of variation of the lognormal latency, 0 = constant.")
@click.option("--error-rate", type=float, default=_DEFAULTS.error_rate,
              help="Fraction of admitted requests answered 500.")
@click.option("--hang-rate", type=float, default=_DEFAULTS.hang_rate,
              help="Fraction of admitted requests that hang.")
@click.option("--hang-s", type=float, default=_DEFAULTS.hang_s, show_default=True,
              help="Seconds a hang lasts.")
@click.option("--token-chars", type=float, default=_DEFAULTS.token_chars, show_default=True,
              help="Characters per token as its tokenizer counts (CJK text: about 1).")
@click.option("--usage/--no-usage", default=_DEFAULTS.usage, show_default=True,
              help="Chat replies carry `usage`.")
@click.option("--degrade-above", default=_DEFAULTS.degrade_above,
              help="Latency doubles above this many requests in flight, 0 = never.")
@click.option("--seed", default=_DEFAULTS.seed, show_default=True, help="Seed of the fault RNG.")
@click.option("--group-reply", type=click.Choice(GROUP_REPLIES), default=_DEFAULTS.group_reply,
              show_default=True, help="How a group prompt's scores are written.")
@click.option("--group-fault-rate", type=float, default=_DEFAULTS.group_fault_rate,
              help="Fraction of group prompts answered with a group fault.")
@click.option("--fooled/--no-fooled", default=_DEFAULTS.fooled,
              help="A weak judge: obeys verdict lines outside a fence, quotes the response.")
@click.option("--tls-cert", default="", help="Serve HTTPS with this PEM certificate.")
@click.option("--tls-key", default="", help="The private key of --tls-cert.")
def mock_judge_cli(**options: Any) -> None:
    """Serve a rate-limited, OpenAI-compatible mock LLM judge until SIGINT or SIGTERM."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    judge = MockJudge(MockJudgeSettings(**options)).start()
    click.echo(f"mock judge listening on {judge.url}")  # click.echo flushes; spawn() waits on it
    try:
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        judge.stop()
