"""The backend interface: everything qrq knows about a kind of backend, in its own class.

A kind says which keys of the `[backend]` table it reads (its `Options` dataclass, and their
checks), what a worker checks before it starts (`preflight`), how many samples one call
takes, what decides its scores (the cache's identity), what a call costs in tokens, what its
replies teach the limiter, and makes the call. The planner, the chunker, the cache,
the loader and the worker's call path ask the kind (`backends.KINDS`), never its name.
The worker task wraps every call in the global limiter and handles retries, so a backend
only turns samples into a request and a reply into scores (or precise errors).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..config.model import Backend, KindOptions
from ..config.toml_table import Table, read_fields
from ..errors import ConfigError, PermanentError, ScoringError
from ..flow.ratelimit_headers import Feedback

MAX_USAGE_TOKENS = 10**12  # more than any call can cost: a larger count is garbage


@dataclass
class Call:
    """What one backend call produced: a score or an error per sample, and what the server said."""

    scores: list[float | ScoringError]
    tokens: int | None = None
    status_code: int | None = None
    headers: Mapping[str, str] | None = None
    details: list[str | None] = field(default_factory=list)
    usage: tuple[int, int] | None = None  # tokens in and out, as the reply reported them


class BackendClient(ABC):
    """One kind of backend, bound to one backend's settings. Subclasses override the facts
    that differ from these defaults (no options of its own, one sample per call, nothing
    learned from replies); `http.HttpBackend` is the base of the kinds that POST."""

    # its calls run on the worker's own CPU, not on a server: one call per task in a pool of
    # processes (`[pool] concurrency`), no `[pool] calls` to size, no tokens spent
    runs_locally: ClassVar[bool] = False
    # its calls only wait on a server (`call_async`): the worker's call loop runs many at
    # once on one thread, where they need no thread each (see worker/call_loop.py)
    awaitable: ClassVar[bool] = False
    default_chunk_size: ClassVar[int | None] = None  # samples per task when the file sets none
    # the kind's own keys of `[backend]` and their defaults (`Backend.options`)
    Options: ClassVar[type[KindOptions]] = KindOptions

    def __init__(self, config: Backend):
        self.config = config

    @classmethod
    def read_options(cls, table: Table) -> KindOptions:
        """This kind's own keys of the `[backend]` table, checked, as its `Options` (a wrong
        one raises or is noted on `table`, naming its file and key). A kind whose keys need
        checks beyond their types reads those itself and passes them to `read_fields`."""
        return read_fields(table, cls.Options)

    def preflight(self) -> list[str]:
        """What `qrq worker` checks before it starts a worker of this backend: the lines it
        prints (a warning begins with "warning: "); raises ConfigError when the backend
        cannot run in this process (by default: its API key variable is unset)."""
        if missing := self.config.missing_api_key():
            raise ConfigError(f"{missing}: export it before starting the worker")
        return []

    @property
    def sends_priority(self) -> bool:
        """Its calls carry their message's priority level (priority.CALL_LEVEL on each sample)."""
        return False

    def connect(self) -> None:
        """Make ready for the calling thread's first call (an HTTP kind opens its connection)."""
        return None

    def units(self, samples: list[dict]) -> list[list[int]]:
        """Positions of `samples` that must travel together: the chunker never cuts one
        across tasks (a judge's group). By default every sample stands alone."""
        return [[i] for i in range(len(samples))]

    @property
    def grouped(self) -> bool:
        """Its calls judge a group of samples together (`units`), one question: a failed call
        is never made again in halves to find a bad sample (as a reward model's batch is),
        and a trainer's per-sample calls are held until their group is complete."""
        return False

    def split(self, samples: list[dict]) -> list[list[int]]:
        """Positions of `samples` grouped into calls: `samples_per_call` at a time."""
        size = self.samples_per_call
        return [list(range(i, min(i + size, len(samples)))) for i in range(0, len(samples), size)]

    @property
    def samples_per_call(self) -> int:
        """Samples one call scores; a chunk is cut in whole calls of this many."""
        return 1

    def identity(self) -> list[Any]:
        """What decides this backend's scores: cached scores are shared only between equal
        identities (of one route). A kind adds the options its scores depend on."""
        return [self.config.kind]

    def estimate_usage(self, samples: list[dict]) -> tuple[float, float]:
        """Tokens in and out the call will cost, before we know (chars / 4, no output)."""
        return sum(len(s["prompt"]) + len(s["response"]) for s in samples) / 4, 0.0

    def input_bytes(self, samples: list[dict]) -> int:
        """UTF-8 bytes of what the call sends to be read: a tokenizer makes at most about one
        token of each, so a budget books an upper bound from it (`flow.spend.Ledger.bound`)."""
        return sum(len(s["prompt"].encode()) + len(s["response"].encode()) for s in samples)

    def estimate_tokens(self, samples: list[dict]) -> float:
        """What the limiter books for the call before it is made."""
        return sum(self.estimate_usage(samples))

    def feedback(self, result: Call | ScoringError) -> Feedback:
        """What the call's reply (or failure) teaches the limiter; by default nothing."""
        return Feedback()

    @abstractmethod
    def call(self, samples: list[dict]) -> Call:
        """Score `samples` in one call; raise a ScoringError when the whole call failed."""

    async def call_async(self, samples: list[dict]) -> Call:
        """`call` on the worker's call loop: an `awaitable` kind's only."""
        raise NotImplementedError(f"calls of kind {self.config.kind!r} do not run on a loop")

    async def connect_async(self) -> None:
        """`connect` on the worker's call loop: one more kept-alive connection."""
        return None


def read_score_range(t: Table, default: tuple[float, float] | None
                     ) -> tuple[float, float] | None:
    """`score_range = [low, high]`: the scores this backend can validly give."""
    value = t.get("score_range", list, None, expected="[low, high]")
    if value is None:
        return default
    numbers = [v for v in value if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if len(value) != 2 or len(numbers) != 2 or not all(map(math.isfinite, numbers)):
        raise t.fail("score_range", "[low, high]: two finite numbers")
    low, high = map(float, numbers)
    if low > high:
        raise t.fail("score_range", "[low, high] with low <= high")
    return low, high


_USAGE_KEYS = (("prompt_tokens", "completion_tokens"), ("input_tokens", "output_tokens"))


def usage_tokens(body: Any) -> int | None:
    """`usage.total_tokens` of a reply when it is a plausible count (Anthropic's: input plus
    output), else None (unknown)."""
    usage = body.get("usage") if isinstance(body, dict) else None
    tokens = usage.get("total_tokens") if isinstance(usage, dict) else None
    if tokens is None and isinstance(usage, dict) and "input_tokens" in usage:
        split = usage_split(body)
        return None if split is None else sum(split)
    return tokens if _plausible(tokens) else None


def usage_split(body: Any) -> tuple[int, int] | None:
    """`usage`'s (prompt_tokens, completion_tokens), or Anthropic's (input_tokens,
    output_tokens), when plausible; a reply giving only `total_tokens` counts it as input;
    else None (unknown)."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return None
    for keys in _USAGE_KEYS:
        counts: list[Any] = [usage.get(k) for k in keys]
        if all(_plausible(c) for c in counts):
            return counts[0], counts[1]
    total = usage.get("total_tokens")
    return (total, 0) if isinstance(total, int) and _plausible(total) else None


def _plausible(tokens: Any) -> bool:
    return isinstance(tokens, int) and not isinstance(tokens, bool) and \
        0 <= tokens <= MAX_USAGE_TOKENS


def checked_score(
    value: Any, score_range: tuple[float, float] | None, what: str, reply: str | None = None
) -> float | PermanentError:
    """`value` as a score, or the error (not raised) that says why it is none.

    Numbers of any size come out of JSON and regexes; one that does not fit a float, is not
    finite or lies outside `score_range` is an error for its own item, quoting `reply`.
    """
    # float() reads "١" and "１" as 1: a score is written in ASCII or it is none
    if isinstance(value, bool) or not isinstance(value, (int, float, str)) or (
            isinstance(value, str) and not value.isascii()):
        return PermanentError(f"{what} is not a number", reply or _preview(value))
    try:
        score = float(value)
    except OverflowError:
        return PermanentError(f"{what} is too large for a float", reply or _preview(value))
    except ValueError:
        return PermanentError(f"{what} is not a number", reply or _preview(value))
    if not math.isfinite(score):
        return PermanentError(f"{what} is not a finite number", reply or _preview(value))
    if score_range is not None and not score_range[0] <= score <= score_range[1]:
        low, high = score_range
        return PermanentError(
            f"{what} is outside score_range [{low:g}, {high:g}]", reply or _preview(value)
        )
    return score


def _preview(value: Any) -> str:
    try:
        text = str(value)
    except ValueError:  # an int past Python's digit limit for str()
        return "<an integer too long to show>"
    return text if len(text) <= 80 else f"{text[:40]}...({len(text)} characters)"
