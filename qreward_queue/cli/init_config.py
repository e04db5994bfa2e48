"""`qrq init`: a commented qrq.toml and one backend file for the user's own judge.

A newcomer's first configuration should load, start a worker and say what each key does, so
the files are written from the flags alone (nothing asked when they are given), checked with
the project's own loader before anything touches the disk, and never written over a file
that exists.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from ..config.loader import load_config
from ..errors import ConfigError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # a backend name, as config.py accepts it
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class JudgeSpec:
    """What `qrq init` was told about the judge."""

    url: str
    model: str
    name: str = "judge"
    api_key_env: str | None = None
    rpm: float | None = None
    max_concurrent: int | None = None

    def check(self) -> None:
        """One ConfigError naming the flag, before anything is written."""
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"--judge-url: expected an http:// or https:// base URL, "
                              f"got {self.url!r}")
        if not self.model.strip():
            raise ConfigError("--model: expected the model name the judge serves")
        if not NAME.fullmatch(self.name):
            raise ConfigError(f"--name: expected letters, digits, '_', '.' or '-', "
                              f"got {self.name!r}")
        if self.api_key_env is not None and not ENV_NAME.fullmatch(self.api_key_env):
            raise ConfigError(f"--api-key-env: expected the NAME of an environment variable "
                              f"(not the key itself), got {self.api_key_env!r}")


def qrq_toml(spec: JudgeSpec) -> str:
    return f"""\
# qrq.toml, written by `qrq init`: one route, {spec.name!r}, on one judge.
# Every key is described in docs/configuration.md.

# Where the backend files are, relative to this file: one file per backend, each with its own
# queue (qrq.<name>) and its own worker pool.
workers_dir = "workers"

# Which Redis. Left out, qrq runs embedded: in-memory queues and in-process workers, limits
# held inside one process only (fine for `qrq score` on one machine). For workers and
# trainers on several processes or machines, set QRQ_REDIS_URL=redis://host:6379/0 in every
# process, or uncomment:
# [redis]
# url = "redis://127.0.0.1:6379/0"

[defaults]
{_pad(f'route = "{spec.name}"')}# submit_batch(route=None), `qrq score` without --route
deadline_s = 600            # a batch returns by then; an unfinished sample comes back `timeout`
fallback_score = 0.0        # the score of a `timeout` or `error` outcome (always with its status)

# A route: backends that give the same reward. Add a second judge's name to spread the batch
# over both (by weight x free capacity) and fail over between them.
[routes.{spec.name}]
backends = ["{spec.name}"]
# cache = true              # keep scores in Redis: a sample seen before comes back `cached`
"""


def _pad(setting: str) -> str:
    """A setting followed by spaces up to the column its comment starts at."""
    return setting.ljust(27) + " "


def backend_toml(spec: JudgeSpec) -> str:
    key = (f'api_key_env = "{spec.api_key_env}"   # the NAME of the variable holding the key, '
           "never the key" if spec.api_key_env else
           '# api_key_env = "JUDGE_API_KEY"  # the NAME of the variable holding its key, if it '
           "needs one")
    rpm = f"rpm = {spec.rpm:g}" if spec.rpm else "# rpm = 600"
    concurrent = (f"max_concurrent = {spec.max_concurrent}" if spec.max_concurrent
                  else "# max_concurrent = 32")
    return f"""\
# workers/{spec.name}.toml, written by `qrq init`: the backend {spec.name!r} (an OpenAI-compatible
# chat judge). Start its worker pool with `qrq worker workers/{spec.name}.toml` (needs Redis:
# QRQ_REDIS_URL); every key is described in docs/configuration.md.

[backend]
kind = "judge"
url = {json.dumps(spec.url)}   # qrq POSTs {{url}}/chat/completions
model = {json.dumps(spec.model)}
{key}
timeout_s = 60              # the total time of one call, however slowly the reply comes
# The default prompt asks for "Score: <number>" between 0 and 1; to grade your own way:
# prompt_template = "...{{prompt}}...{{response}}...{{reference}}..."
# score_pattern = 'Score:\\s*([0-9.]+)'   # one group: the score

# The judge's limits, held by every worker together through Redis (set them to your
# account's or server's; left out, qrq sends as fast as the workers' calls allow).
[limits]
{_pad(rpm)}# requests per minute
{_pad(concurrent)}# calls in flight at once
# tpm = 200000              # tokens per minute

# [pool] left out: each worker sizes its calls in flight itself from the rpm and the latency.
"""


def write_starter(spec: JudgeSpec, directory: Path) -> list[Path]:
    """Write qrq.toml and workers/<name>.toml under `directory`; refuse when either exists.
    The files are loaded with qrq's own loader first, in a scratch directory."""
    spec.check()
    files = {directory / "qrq.toml": qrq_toml(spec),
             directory / "workers" / f"{spec.name}.toml": backend_toml(spec)}
    for path in files:
        if path.exists():
            raise ConfigError(f"{path} exists: qrq init writes only new files (move it away, "
                              "or give --dir another directory)")
    with tempfile.TemporaryDirectory(prefix="qrq-init-") as scratch:
        for path, text in files.items():
            trial = Path(scratch) / path.relative_to(directory)
            trial.parent.mkdir(parents=True, exist_ok=True)
            trial.write_text(text)
        load_config(Path(scratch) / "qrq.toml")  # a bug here would be ours: fail loudly
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return list(files)
