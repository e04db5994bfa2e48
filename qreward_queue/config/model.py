"""What qrq.toml and workers/<backend>.toml say, as frozen values: the configuration model.

`loader.py` reads and checks the files into these; everything else only reads them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from ..errors import ConfigError, UnknownRoute
from ..flow.ratelimit_headers import DEFAULT_MAX_PAUSE_S
from ..message import DEFAULT_JOB
from ..redact import remember
from ..samples import DEFAULT_MAX_SAMPLE_BYTES
from .toml_table import env_names

PACKAGED_CONFIG = Path(__file__).resolve().parents[1] / "defaults" / "qrq.toml"


@dataclass(frozen=True)
class Limits:
    """What the backend allows; the global limiter enforces these across all workers."""

    rpm: float | None = None
    tpm: float | None = None
    max_concurrent: int | None = None
    burst_s: float = 1.0
    max_pause_s: float = DEFAULT_MAX_PAUSE_S  # the longest pause one backend reply can order


def advised_calls(
    limits: Limits, latency_s: float, workers: int = 1, want_per_s: float | None = None
) -> int:
    """Calls in flight per worker process (`[pool] calls`) for a backend: the pool-sizing rule
    of docs/operations.md ("Sizing a pool") and the examples.

    Calls in flight for the whole backend = 3 x rate x latency (Little's law, tripled for the
    spread of latencies and the worker's own time per task: 2x fell to 71-85% of the limit on
    a loaded machine, 3x held 100%), rate = rpm/60 or, with no rpm, the rate you want
    (`want_per_s`); at least 8, at most max_concurrent; with no rate at all, max_concurrent.
    Split over `workers`.
    """
    rate = limits.rpm / 60 if limits.rpm else want_per_s
    total = max(8, math.ceil(3 * rate * latency_s)) if rate else limits.max_concurrent
    if total is None:
        raise ValueError("a backend with no rpm and no max_concurrent needs want_per_s")
    if limits.max_concurrent:
        total = min(total, limits.max_concurrent)
    return math.ceil(total / workers)


# With no `calls` in the file, a worker process sizes its calls in flight itself
# (worker/call_pool.py):
PROCESS_CALLS = 64  # where it starts, and its size with no limit known (an asyncio client's 64)
MAX_PROCESS_CALLS = 256  # the most it grows to, under max_concurrent and rpm x latency
BUSY_TASKS = 8  # chunk tasks at once per process beyond which `concurrency` only costs


@dataclass(frozen=True)
class Pool:
    """How the Celery worker pool for one backend runs."""

    type: str = "threads"
    # chunk tasks at once per worker process: while one waits for the last, slowest calls of
    # its chunk, the others' calls keep the process's `calls` busy
    concurrency: int = 4
    rate_limit: str | None = None
    # backend calls in flight per worker process, shared by its tasks: with no `calls` in the
    # file (`sized`), the most the pool may size itself to (see call_pool.CallSizing)
    calls: int = PROCESS_CALLS
    sized: bool = True
    # function backends: the helper process that runs the function (see backends/function_runner.py)
    memory_limit_mb: int | None = 2048
    max_tasks_per_child: int = 1000
    max_memory_per_child_mb: int | None = None


@dataclass(frozen=True)
class Retry:
    """Retries of retryable errors (429, timeouts, 5xx) before failing over or giving up; a
    timeout or 5xx is tried again inside its chunk's run while its backoff is short.
    429s the limiter turns into flow control (a shared pause, a concurrency cut) spend one
    attempt per `rate_limited_per_attempt` in a row (0: each spends one), so a hostile server
    still cannot hold a sample for ever; any other 429 spends one."""

    attempts: int = 4
    rate_limited_per_attempt: int = 10
    backoff_base_s: float = 0.5
    backoff_cap_s: float = 10.0
    jitter: bool = True
    breaker_threshold: int = 5
    breaker_cooldown_s: float = 30.0
    # a call on the call loop whose reply is far later than the backend's usual gets a second
    # call (see CallPath); off under a [budget], which books one call per sample
    hedge: bool = True


@dataclass(frozen=True)
class Price:
    """What a backend charges per million tokens in and out (`[price]`); gives spend a cost."""

    input_per_million: float = 0.0
    output_per_million: float = 0.0


@dataclass(frozen=True)
class Budget:
    """The most a backend may spend (`[budget]`), shared by every worker through Redis: in
    tokens (in + out) or cost (needs `[price]`), per UTC hour and/or in total; None: no cap."""

    tokens_per_hour: float | None = None
    tokens_total: float | None = None
    cost_per_hour: float | None = None
    cost_total: float | None = None

    def limits(self) -> dict[str, float]:
        """The caps that are set, by name."""
        return {k: v for k, v in vars(self).items() if v is not None}


@dataclass(frozen=True)
class KindOptions:
    """The base of a kind's options dataclass (`JudgeOptions`...: the keys of `[backend]` that
    only its kind reads, with their defaults); a kind with no keys of its own has these."""

    def call_time_values(self) -> tuple[tuple[str, str, str], ...]:
        """(table, key, value) of the values read at call time (a header naming `${VAR}`)."""
        return ()


OptionsT = TypeVar("OptionsT", bound=KindOptions)


@dataclass(frozen=True)
class Backend:
    """One endpoint or function: its own limits, its own queue `qrq.<name>`, its own pool."""

    name: str
    kind: str
    api_key_env: str | None = None
    timeout_s: float = 60.0
    chunk_size: int | None = None  # samples per task; None: sized by the planner
    # the kind's own keys of `[backend]`: its options dataclass (backends/<kind>.py)
    options: KindOptions = field(default_factory=KindOptions)
    limits: Limits = field(default_factory=Limits)
    pool: Pool = field(default_factory=Pool)
    retry: Retry = field(default_factory=Retry)
    price: Price | None = None
    budget: Budget | None = None
    source: str = "<memory>"

    @property
    def queue(self) -> str:
        return f"qrq.{self.name}"

    def options_as(self, cls: type[OptionsT]) -> OptionsT:
        """The kind's options, as the kind's own dataclass `cls` (a backend made in Python
        with another kind's options is refused, naming both)."""
        if not isinstance(self.options, cls):
            raise ConfigError(f"{self.source}: backend {self.name!r}: kind {self.kind!r} takes "
                              f"{cls.__name__}, got {type(self.options).__name__}")
        return self.options

    def api_key(self) -> str | None:
        """Read the key from the environment at call time; it never enters a message, and
        from now on this process redacts it wherever a backend's reply quotes it."""
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        remember(key)
        return key

    def missing_api_key(self) -> str | None:
        """Why this process cannot call the backend (its key variable, or one a header or
        query parameter names, is unset), else None.

        A backend-level problem, not a sample's: `qrq worker` refuses to start on it, and the
        worker side treats it like an open circuit (the work fails over to a sibling).
        """
        if self.api_key_env and not os.environ.get(self.api_key_env):
            return (
                f"{self.source}: backend.api_key_env: environment variable {self.api_key_env} "
                f"(the API key of backend {self.name!r}) is not set in this process"
            )
        for table, key, value in self.options.call_time_values():
            for name in env_names(value):
                if name not in os.environ:
                    return (f"{self.source}: backend.{table}.{key}: environment variable "
                            f"{name} is not set in this process")
        return None


@dataclass(frozen=True)
class Audit:
    """A route's audit lane: a seeded `fraction` of its `ok` outcomes judged again on `route`
    at bulk priority after the batch returns (ops/audit.py); a score at or above
    `threshold` passes."""

    route: str
    fraction: float
    threshold: float = 0.5
    seed: int = 0


@dataclass(frozen=True)
class Route:
    """A reward name a trainer uses: backends that produce the same score, with weights."""

    name: str
    backends: tuple[str, ...]
    weights: tuple[float, ...]
    cache: bool = False
    cache_ttl_s: float = 86400.0
    # an ensemble (planning/ensemble.py): `votes` scores per sample, vote j on
    # backends[j % len], each a call under its own backend's limits; aggregated by `aggregate`
    # over at least `quorum`
    votes: int | None = None
    aggregate: str = "mean"
    quorum: int = 1
    temperature: float = 1.0  # of a judge asked again (more votes than backends)
    # a response flagged as addressing its judge (backends/injection.py): "score" (flag only), "min"
    # (an ensemble's lowest vote), "zero" (score 0, saying why)
    on_injection: str = "score"
    audit: Audit | None = None


@dataclass(frozen=True)
class GatewaySettings:
    """`[gateway]`: where `qrq gateway` reads its API keys (secrets: an environment variable or
    a file, never qrq.toml itself), each naming a job, and each job's `[budget]`."""

    keys_env: str | None = None
    keys_file: str | None = None
    budgets: dict[str, Budget] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class JobSettings:
    """One `[jobs.<name>]` table: the job's weight in fair shares and its `[budget]`."""

    weight: float = 1.0
    budget: Budget | None = None


@dataclass(frozen=True)
class Jobs:
    """`[jobs]`: the job of a process that names none (`name`), how many jobs Prometheus
    labels (`max_labels`; the rest are `other`), whether jobs share backends fairly
    (`fair_shares`), and each named job's weight and budget (a job not named here: weight 1,
    no budget)."""

    name: str = DEFAULT_JOB
    max_labels: int = 20
    fair_shares: bool = True  # false: every chunk is published at once (no gate)
    each: dict[str, JobSettings] = field(default_factory=dict, hash=False)

    def weight(self, job: str) -> float:
        known = self.each.get(job)
        return known.weight if known else 1.0

    def budget(self, job: str) -> Budget | None:
        known = self.each.get(job)
        return known.budget if known else None

    def budgets(self) -> dict[str, Budget]:
        """The jobs that have a budget, and it."""
        return {job: s.budget for job, s in self.each.items() if s.budget is not None}


@dataclass(frozen=True)
class Config:
    """Everything qrq.toml and the backend files say."""

    redis_url: str | None
    backends: dict[str, Backend]
    routes: dict[str, Route]
    default_route: str | None = None
    deadline_s: float = 600.0
    fallback_score: float = 0.0
    max_sample_bytes: int = DEFAULT_MAX_SAMPLE_BYTES
    result_expires_s: int = 6 * 3600
    visibility_timeout_s: int = 900
    lease_s: float = 15.0  # workers stop calling for a batch this long after its client died
    source: str = "<memory>"
    redis_service_name: str | None = None  # the Sentinel service (master name)
    redis_password_env: str | None = None
    sentinel_password_env: str | None = None
    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    jobs: Jobs = field(default_factory=Jobs)

    @property
    def embedded(self) -> bool:
        return self.redis_url is None

    def route(self, name: str | None) -> Route:
        """The route called `name` (a bare backend name is a one-backend route)."""
        name = name or self.default_route
        if name is None and self.source == "<memory>":
            raise UnknownRoute(f"no route given: {config_not_found(_FROM_PYTHON)}")
        if name is None:
            raise UnknownRoute(f"no route given and {self.source} sets no [defaults] route")
        if name in self.routes:
            return self.routes[name]
        if name in self.backends:
            return Route(name=name, backends=(name,), weights=(1.0,))
        if self.source == "<memory>" and not self.backends:
            raise UnknownRoute(f"no route {name!r}: {config_not_found(_FROM_PYTHON)}")
        known = ", ".join(sorted({*self.routes, *self.backends})) or "none"
        raise UnknownRoute(f"unknown route or backend {name!r} (known: {known})")

    def backend(self, name: str) -> Backend:
        try:
            return self.backends[name]
        except KeyError:
            raise UnknownRoute(f"unknown backend {name!r}") from None


_FROM_PYTHON = "call qreward_queue.configure(FILE) or set QRQ_CONFIG=FILE"


def config_not_found(how: str = "pass --config FILE or set QRQ_CONFIG=FILE") -> str:
    """Where the default lookup looked, and `how` to point it at a file."""
    return (
        f"no qrq.toml found ($QRQ_CONFIG is unset and there is no {Path.cwd() / 'qrq.toml'}); "
        f"{how} (an example ships with qrq: {PACKAGED_CONFIG})"
    )

