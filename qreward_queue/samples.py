"""Samples in, outcomes out: the two records that cross the queue, and sample validation."""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import InvalidSamples, ScoringError
from .redact import redact

Status = Literal["ok", "cached", "timeout", "error", "cancelled"]
STATUSES: tuple[str, ...] = ("ok", "cached", "timeout", "error", "cancelled")
DEFAULT_MAX_SAMPLE_BYTES = 1 << 20
# lists and objects inside a sample's 'extra' or 'id': every JSON encoder and decoder on the
# way (the client's, kombu's, the worker's, a backend's request) recurses once per level
MAX_NESTING = 100

_REQUIRED_TEXT = ("prompt", "response")
_OPTIONAL_TEXT = ("reference", "data_source")
_TEXT = (*_REQUIRED_TEXT, *_OPTIONAL_TEXT)
# `group`: the GRPO group a judge in group mode scores it with (else: its prompt's);
# `group_size`: how many samples that group has (the micro-batcher waits for all of them)
_KNOWN_KEYS = frozenset({*_TEXT, "extra", "id", "group", "group_size"})


@dataclass
class Outcome:
    """What became of one sample. A fallback score always comes with its status and reason.

    Workers leave `score` None on failures; `placed` gives every outcome its sample's id and
    failures the configured fallback score, in one place, as the client hands them over.
    """

    score: float | None
    status: Status = "ok"
    backend: str | None = None
    attempts: int = 0
    latency_ms: float = 0.0
    error: str | None = None
    detail: str | None = None
    id: Any = field(default=None)

    def __post_init__(self) -> None:  # both may quote a backend's reply
        self.error, self.detail = redact(self.error), redact(self.detail)

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))  # the fields are JSON values already: no deep copy (asdict's)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Outcome:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    @classmethod
    def failed(cls, error: ScoringError, backend: str | None = None, attempts: int = 0,
               latency_ms: float = 0.0, note: str = "") -> Outcome:
        """The outcome an error stands for: its status (`error`, `timeout`), message and detail."""
        return cls(None, error.status, backend, attempts, latency_ms,  # type: ignore[arg-type]
                   error=f"{error}{note}", detail=error.detail)

    def placed(self, sample_id: Any, fallback_score: float) -> Outcome:
        """This outcome as the trainer gets it: the sample's id, the fallback score on failure.
        A copy field for field: its texts were redacted when it was made (`replace` would
        redact them again, for every sample of a batch)."""
        placed = object.__new__(Outcome)
        placed.__dict__.update(vars(self), id=sample_id,
                               score=self.score if self.scored else fallback_score)
        return placed

    @property
    def reward(self) -> float:
        """`score` as a trainer takes it: every outcome a batch hands over has one (`placed`)."""
        if self.score is None:
            raise ValueError(f"outcome of sample {self.id!r} not placed yet: no score")
        return float(self.score)

    @property
    def scored(self) -> bool:
        """True when the score came from a backend (now or from the cache)."""
        return self.status in ("ok", "cached")


def summarize(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """What a trainer logs about a step's outcomes: samples by status and by backend, retries
    (extra attempts), cache hits, responses flagged as addressing their judge and the mean
    latency of scored samples."""
    by_status: dict[str, int] = {}
    by_backend: dict[str, int] = {}
    for o in outcomes:
        by_status[o.status] = by_status.get(o.status, 0) + 1
        if o.backend:
            by_backend[o.backend] = by_backend.get(o.backend, 0) + 1
    scored = [o.latency_ms for o in outcomes if o.status == "ok"]
    return {
        "samples": len(outcomes),
        "by_status": by_status,
        "by_backend": by_backend,
        "retries": sum(max(0, (o.attempts or 0) - 1) for o in outcomes),
        "cache_hits": by_status.get("cached", 0),
        # responses that address their judge (backends/injection.py), flagged in their detail
        "injection_flagged": sum(bool(flagged(o.detail)) for o in outcomes),
        "mean_latency_ms": round(sum(scored) / len(scored), 1) if scored else None,
    }


def sample_problem(sample: Any, max_bytes: int = DEFAULT_MAX_SAMPLE_BYTES) -> str | None:
    """Why `sample` cannot be scored, or None when it is fine."""
    if not isinstance(sample, dict):
        return f"expected a dict with 'prompt' and 'response', got {type(sample).__name__}"
    for key in _REQUIRED_TEXT:
        if key not in sample:
            return f"missing field '{key}'"
        if not isinstance(sample[key], str):
            return f"field '{key}' must be a string, got {type(sample[key]).__name__}"
    for key in _OPTIONAL_TEXT:
        if sample.get(key) is not None and not isinstance(sample[key], str):
            return f"field '{key}' must be a string, got {type(sample[key]).__name__}"
    unknown = sorted(map(repr, set(sample) - _KNOWN_KEYS))
    if unknown:
        return f"unknown field(s) {', '.join(unknown)} (put your own data in 'extra')"
    group, size = sample.get("group"), sample.get("group_size")
    if group is not None and (isinstance(group, bool) or not isinstance(group, (str, int))):
        return f"field 'group' must be a string or an integer, got {type(group).__name__}"
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        return f"field 'group_size' must be an integer >= 1, got {size!r}"
    extra = sample.get("extra")
    if extra is not None and not isinstance(extra, dict):
        return f"field 'extra' must be a JSON object, got {type(extra).__name__}"
    # the text's UTF-8 size plus the JSON of the rest: no full encoding of every sample
    size = sum(len(sample[k].encode("utf-8", "surrogatepass")) for k in _TEXT if sample.get(k))
    rest = {k: sample[k] for k in ("extra", "id", "group") if sample.get(k) is not None}
    for key in ("extra", "id"):
        if (why := _shape_problem(key, rest.get(key), max_bytes)) is not None:
            return why
    if rest:
        try:
            size += len(json.dumps(rest, allow_nan=False))
        except (TypeError, ValueError) as exc:
            return f"not JSON-serializable ({exc})"
    if size > max_bytes:
        return f"{size} bytes exceeds the {max_bytes}-byte cap per sample"
    return None


def _shape_problem(key: str, value: Any, max_bytes: int) -> str | None:
    """Why `value` is too deep or has too many parts to serialise, found without recursion and
    before any encoding (a self-containing value is found too deep)."""
    max_values = max_bytes // 2  # each value takes at least 2 bytes of JSON with its separator
    values = 0
    todo = [(value, 1)]
    while todo:
        node, depth = todo.pop()
        parts: Collection[Any]
        if isinstance(node, dict):
            parts = node.values()
        elif isinstance(node, (list, tuple)):
            parts = node
        else:
            continue
        if depth > MAX_NESTING:
            return f"field {key!r} is nested more than {MAX_NESTING} levels deep"
        values += len(parts)
        if values > max_values:
            return (f"field {key!r} holds more than {max_values} values: over the "
                    f"{max_bytes}-byte cap per sample")
        todo.extend((part, depth + 1) for part in parts)
    return None


def validate_samples(
    samples: Sequence[Any], max_bytes: int = DEFAULT_MAX_SAMPLE_BYTES, raise_errors: bool = True
) -> dict[int, str]:
    """Check every sample; raise InvalidSamples naming each bad index, or return them."""
    if isinstance(samples, (str, bytes, dict)) or not isinstance(samples, Sequence):
        raise InvalidSamples({-1: f"samples must be a list of dicts, got {type(samples).__name__}"})
    problems = {
        i: why for i, s in enumerate(samples) if (why := sample_problem(s, max_bytes)) is not None
    }
    if problems and raise_errors:
        raise InvalidSamples(problems)
    return problems


# A response that addresses its judge is flagged at the head of its outcome's detail
# (backends/injection.py tells the classes).
FLAG_HEAD = "injection suspected ("


def flag(kinds: Sequence[str], detail: str | None) -> str | None:
    """`detail` with the flag of `kinds` at its head (unchanged when there are none)."""
    if not kinds:
        return detail
    return f"{FLAG_HEAD}{', '.join(kinds)}): {detail or ''}"


def flagged(detail: str | None) -> tuple[str, ...]:
    """The classes a flagged `detail` names (an ensemble's JSON detail: its "injection")."""
    if not detail:
        return ()
    if detail.startswith(FLAG_HEAD):
        return tuple(detail[len(FLAG_HEAD):detail.find(")")].split(", "))
    if detail.startswith("{") and '"injection"' in detail:
        try:
            return tuple(json.loads(detail).get("injection") or ())
        except (ValueError, AttributeError):
            return ()
    return ()
