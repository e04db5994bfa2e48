"""Who may call `qrq gateway`: API keys, each naming a job and the priorities it may ask for.

The keys are secrets, so qrq.toml only names where they are (`[gateway] keys_env` or
`keys_file`): a JSON list in the variable, or the same entries in a TOML (`[[keys]]`) or JSON
file:

    [[keys]]
    key = "qrq-team-a-..."        # what the caller sends as `Authorization: Bearer <key>`
    job = "team-a"                 # its spend is counted (and its [gateway.budget.<job>] held)
    priorities = ["train", "bulk"] # the priorities its requests may ask for (default: all)

Only the keys' SHA-256 digests are kept in memory; no message names a key. With no keys
configured every caller is served as one job, `default`, at any priority (and `qrq gateway`
says so at start).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config.model import GatewaySettings
from ..config.toml_table import read_toml
from ..errors import ConfigError
from ..message import DEFAULT_JOB, job_problem
from ..priority import Priority

OPEN_JOB = DEFAULT_JOB


@dataclass(frozen=True)
class Job:
    """A caller of the gateway: its name and the priorities it may use (default: train if it
    may, else its first)."""

    name: str
    priorities: tuple[Priority, ...] = (Priority.TRAIN, Priority.VAL, Priority.BULK)

    def priority(self, asked: str | None) -> Priority:
        """The priority a request of this job runs at: `asked` if allowed (else a
        PermissionError naming the allowed ones; ValueError: no such priority), or its default."""
        if asked is None:
            return Priority.TRAIN if Priority.TRAIN in self.priorities else self.priorities[0]
        wanted = Priority.parse(asked)
        if wanted not in self.priorities:
            allowed = ", ".join(p.value for p in self.priorities)
            raise PermissionError(f"priority {wanted.value!r} is not allowed for job "
                                  f"{self.name!r} (allowed: {allowed})")
        return wanted


class Keys:
    """The configured keys, by digest; `open` when there are none."""

    def __init__(self, jobs: dict[str, Job]):
        self._by_digest = {_digest(key): job for key, job in jobs.items()}

    @property
    def open(self) -> bool:
        return not self._by_digest

    def job(self, authorization: str | None) -> Job | None:
        """The job of an `Authorization: Bearer <key>` header (None: no such key)."""
        if self.open:
            return Job(OPEN_JOB)
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        return self._by_digest.get(_digest(key.strip()))

    @classmethod
    def load(cls, settings: GatewaySettings) -> Keys:
        """The keys `[gateway]` points at (none: an open gateway); a wrong entry is a
        ConfigError naming where and which entry, never the key."""
        entries: list[tuple[str, Any]] = []
        if settings.keys_env:
            text = os.environ.get(settings.keys_env)
            if text is None:
                raise ConfigError(f"[gateway] keys_env: environment variable "
                                  f"{settings.keys_env} is not set")
            entries.append((f"environment variable {settings.keys_env}", _json(text)))
        if settings.keys_file:
            path = Path(settings.keys_file)
            data = read_toml(path).get("keys") if path.suffix == ".toml" else \
                _json(_read(path))
            entries.append((str(path), data))
        jobs: dict[str, Job] = {}
        for where, data in entries:
            if not isinstance(data, list):
                raise ConfigError(f"{where}: expected a list of keys ({{key, job, priorities}})")
            for i, entry in enumerate(data):
                key, job = _entry(entry, f"{where}: key #{i + 1}")
                jobs[key] = job
        return cls(jobs)


def _entry(entry: Any, where: str) -> tuple[str, Job]:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a table with key, job and priorities")
    unknown = sorted(set(entry) - {"key", "job", "priorities"})
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}")
    key, name = entry.get("key"), entry.get("job")
    if not isinstance(key, str) or len(key.strip()) < 8 or key != key.strip():
        raise ConfigError(f"{where}: key: expected a string of 8 characters or more, without "
                          "surrounding spaces (the value is not shown)")
    if not isinstance(name, str) or job_problem(name) is not None:
        raise ConfigError(f"{where}: job: {job_problem(name)}")
    names = entry.get("priorities", [p.value for p in Job(name).priorities])
    try:
        if not isinstance(names, list) or not names:
            raise ValueError(f"expected a non-empty list, got {names!r}")
        priorities = tuple(dict.fromkeys(Priority.parse(p) for p in names))
    except ValueError as exc:
        raise ConfigError(f"{where}: priorities: {exc}") from None
    return key, Job(name, priorities)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the gateway's keys ({exc.strerror})") from None


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise ConfigError("the gateway's keys are not valid JSON (the text is not shown)") \
            from None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
