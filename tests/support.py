"""Helpers for end-to-end tests: config files on disk and real `qrq worker` subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(value)


def toml_tables(tables: dict[str, dict]) -> str:
    """Render {"backend": {...}, "limits": {...}} as TOML tables."""
    out = []
    for name, table in tables.items():
        out.append(f"[{name}]")
        out += [f"{k} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(out) + "\n"


def judge_backend(url: str, *, rpm=0, max_concurrent=32, concurrency=8, **backend) -> dict:
    """A judge backend definition pointing at a mock judge."""
    return {
        "backend": {
            "kind": "judge",
            "url": url + "/v1",
            "model": "mock",
            "timeout_s": 10,
            **backend,
        },
        "limits": {"rpm": rpm, "max_concurrent": max_concurrent},
        "pool": {"type": "threads", "concurrency": concurrency},
        "retry": {"attempts": 3, "backoff_base_s": 0.1, "backoff_cap_s": 1.0},
    }


def write_config(
    directory: Path,
    backends: dict[str, dict],
    redis_url: str | None = None,
    routes: dict[str, list[str]] | None = None,
    **defaults,
) -> Path:
    """qrq.toml plus workers/<name>.toml under `directory`; returns the qrq.toml path."""
    workers = directory / "workers"
    workers.mkdir(parents=True, exist_ok=True)
    for name, tables in backends.items():
        (workers / f"{name}.toml").write_text(toml_tables(tables))
    lines = ['workers_dir = "workers"']
    if redis_url:
        lines += ["[redis]", f"url = {toml_value(redis_url)}"]
    lines += ["[defaults]"] + [f"{k} = {toml_value(v)}" for k, v in defaults.items()]
    for name, members in (routes or {}).items():
        lines += [f"[routes.{name}]", f"backends = {toml_value(members)}"]
    path = directory / "qrq.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


class Worker:
    """A real `qrq worker` subprocess; waits until Celery says it is ready."""

    def __init__(
        self,
        config: Path,
        backend: str,
        name: str | None = None,
        timeout_s=30.0,
        extra_env: dict[str, str] | None = None,
    ):
        self.log = config.parent / f"worker-{name or backend}-{time.monotonic_ns()}.log"
        env = {**os.environ, "QRQ_CONFIG": str(config), **(extra_env or {})}
        env.pop("QRQ_REDIS_URL", None)
        cmd = [
            sys.executable,
            "-m",
            "qreward_queue.cli",
            "worker",
            str(config.parent / "workers" / f"{backend}.toml"),
            "--loglevel",
            "INFO",
        ]
        if name:
            cmd += ["-n", name]
        with self.log.open("w") as fh:
            self.proc = subprocess.Popen(
                cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while "ready." not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"worker did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL the whole worker (main process and pool children)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
