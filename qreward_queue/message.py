"""The score_chunk task's message contract: its name and the kwargs the client sends and the
worker reads (one module both import, so the two cannot drift apart).

The client sends `backend, samples, route, deadline, batch, indices, job` (`chunk_kwargs`); a task
that retries itself adds `done` (outcomes settled so far), `attempt` and `tried` (backends
failed over from). The worker reads them as a `ChunkMessage`, checked before the task takes
anything (a malformed one is dead-lettered with its reason: `ops/dead_letter.py`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

TASK_NAME = "qrq.score_chunk"
DEFAULT_JOB = "default"  # the job of a process that names none
JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # also a Prometheus label value


def job_problem(name: object) -> str | None:
    """Why `name` cannot be a job's name (None: it can)."""
    if isinstance(name, str) and JOB_NAME.fullmatch(name):
        return None
    return (f"expected a job's name: 1 to 64 letters, digits, '.', '_' or '-' (a letter or "
            f"digit first), got {name!r}")



class MalformedMessage(ValueError):
    """A score_chunk message that breaks the contract; the message names the field."""


def chunk_kwargs(backend: str, samples: list[dict], route: list[str], deadline: float,
                 batch: str, indices: list[int], job: str) -> dict:
    """The kwargs of a new chunk's task (JSON-serializable)."""
    return {"backend": backend, "samples": samples, "route": route, "deadline": deadline,
            "batch": batch, "indices": indices, "job": job}


@dataclass(frozen=True)
class ChunkMessage:
    """A score_chunk task's kwargs, checked and typed. `done`: an outcome dict (or None) per
    sample; `indices`: the samples' places in batch `batch` (both or neither); `job`: whose
    work it is (fair shares, spend per job; a message from before jobs: `default`)."""

    backend: str
    samples: list[dict]
    route: list[str] = dataclasses.field(default_factory=list)
    deadline: float | None = None
    done: list[dict | None] | None = None
    tried: list[str] = dataclasses.field(default_factory=list)
    attempt: int = 1
    batch: str | None = None
    indices: list[int] | None = None
    job: str = DEFAULT_JOB

    @classmethod
    def from_kwargs(cls, kwargs: Any) -> ChunkMessage:
        """The message of `kwargs`; MalformedMessage naming the first field that is wrong."""
        if not isinstance(kwargs, dict):
            raise MalformedMessage(f"kwargs must be an object, got {type(kwargs).__name__}")
        unknown = sorted(set(kwargs) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise MalformedMessage(f"unknown field(s) {', '.join(map(repr, unknown))}")
        if "backend" not in kwargs or "samples" not in kwargs:
            raise MalformedMessage("fields 'backend' and 'samples' are required")
        message = cls(**{k: v for k, v in kwargs.items() if v is not None or k in _NULLABLE})
        message._check()
        return message

    def to_kwargs(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def retried(self, **changes: Any) -> dict[str, Any]:
        """The kwargs of this task sent again with `changes`."""
        return dataclasses.replace(self, **changes).to_kwargs()

    def _check(self) -> None:
        n = len(self.samples) if isinstance(self.samples, list) else -1
        problems = [
            (isinstance(self.backend, str) and self.backend != "", "backend must be a name"),
            (n >= 0 and all(isinstance(s, dict) for s in self.samples),
             "samples must be a list of sample objects"),
            (_strings(self.route), "route must be a list of backend names"),
            (_strings(self.tried), "tried must be a list of backend names"),
            (self.deadline is None or _number(self.deadline), "deadline must be a number"),
            (type(self.attempt) is int and self.attempt >= 1,
             "attempt must be a whole number >= 1"),
            (self.done is None or (isinstance(self.done, list) and len(self.done) == n and all(
                d is None or isinstance(d, dict) for d in self.done)),
             "done must be a list of outcome objects (or null), one per sample"),
            ((self.batch is None) == (self.indices is None),
             "batch and indices go together"),
            (self.batch is None or isinstance(self.batch, str), "batch must be an id"),
            (self.indices is None or (isinstance(self.indices, list) and len(self.indices) == n
                                      and all(type(i) is int and i >= 0 for i in self.indices)),
             "indices must be a list of sample positions, one per sample"),
            (job_problem(self.job) is None, f"job: {job_problem(self.job)}"),
        ]
        for ok, problem in problems:
            if not ok:
                raise MalformedMessage(problem)


_NULLABLE = {"deadline", "done", "batch", "indices"}


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def summary(backend: str, samples: list) -> dict[str, str]:
    """How a task's arguments show in Flower and logs: never the prompts themselves."""
    return {"argsrepr": f"({backend!r}, <{len(samples)} samples>)", "kwargsrepr": "{}"}
