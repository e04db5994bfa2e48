"""Load and check qrq.toml and workers/<backend>.toml; every mistake names its file and key.

qrq.toml is found through QRQ_CONFIG (a path), else ./qrq.toml; QRQ_REDIS_URL overrides its
`[redis] url`. With no URL at all qrq runs in embedded mode (in-process broker and workers).
The package ships an example configuration (`defaults/`: the demo's two mock judges, a reward
model and a CPU reward) so that `qrq demo` runs from any directory and from a wheel.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Collection
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .errors import ConfigError, UnknownRoute
from .ratelimit_headers import DEFAULT_MAX_PAUSE_S
from .redact import remember

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

KINDS = ("judge", "reward_model", "function")
POOLS = ("threads", "prefork", "solo")
DEFAULT_TEMPLATE = (
    "Rate the response to the prompt on a scale from 0 to 1.\n"
    "Prompt: {prompt}\nResponse: {response}\nReference: {reference}\n"
    "Answer with 'Score: <number>'."
)
# the exponent is part of the number, so "Score: 1e309" reads as 1e309 (an error), never as 1
DEFAULT_SCORE_PATTERN = r"Score:\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"
SCORE_MATCHES = ("unique", "first", "last")
_RATE_LIMIT = re.compile(r"^\d+(\.\d+)?/[smh]$")
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
PACKAGED_CONFIG = Path(__file__).resolve().parent / "defaults" / "qrq.toml"


def redact_url(url: str) -> str:
    """`url` without user name or password, safe for messages and logs."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def expand_env(value: str, where: str) -> str:
    """Fill `${VAR}` / `${VAR:-default}` from the environment (for per-deployment hosts)."""

    def fill(match: re.Match) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is None:
            raise ConfigError(f"{where}: environment variable {name} is not set (and no default)")
        return default

    return _ENV_REF.sub(fill, value)


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
    of the README and the examples.

    Calls in flight for the whole backend = 3 x rate x latency (Little's law, tripled for the
    spread of latencies and the worker's own time per task: 2x fell to 71-85% of the limit on
    a loaded machine, 3x held 100%), rate = rpm/60 or, with no rpm, the rate you want
    (`want_per_s`); at least 8, at most max_concurrent; with no rate at all, max_concurrent.
    Split over `workers`.
    """
    rate = limits.rpm / 60 if limits.rpm else want_per_s
    if rate is None and limits.max_concurrent is None:
        raise ValueError("a backend with no rpm and no max_concurrent needs want_per_s")
    total = max(8, math.ceil(3 * rate * latency_s)) if rate else limits.max_concurrent
    if limits.max_concurrent:
        total = min(total, limits.max_concurrent)
    return math.ceil(total / workers)


# With no `calls` in the file, a worker process sizes its calls in flight itself (call_pool.py):
PROCESS_CALLS = 64  # where it starts, and its size with no limit known (an asyncio client's 64)
MAX_PROCESS_CALLS = 256  # the most it grows to, under max_concurrent and rpm x latency
BUSY_TASKS = 8  # chunk tasks at once per process beyond which `concurrency` only costs


@dataclass(frozen=True)
class Pool:
    """How the Celery worker pool for one backend runs."""

    type: str = "threads"
    concurrency: int = 2  # chunk tasks at once per worker process
    rate_limit: str | None = None
    # backend calls in flight per worker process, shared by its tasks: with no `calls` in the
    # file (`sized`), the most the pool may size itself to (see call_pool.CallSizing)
    calls: int = PROCESS_CALLS
    sized: bool = True
    # function backends: the helper process that runs the function (see backends/function.py)
    memory_limit_mb: int | None = 2048
    max_tasks_per_child: int = 1000
    max_memory_per_child_mb: int | None = None


@dataclass(frozen=True)
class Retry:
    """Retries of retryable errors (429, timeouts, 5xx) before failing over or giving up.
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
class Backend:
    """One endpoint or function: its own limits, its own queue `qrq.<name>`, its own pool."""

    name: str
    kind: str
    url: str | None = None
    model: str | None = None
    api_key_env: str | None = None
    timeout_s: float = 60.0
    chunk_size: int | None = None  # samples per task; None: sized by the planner
    prompt_template: str = DEFAULT_TEMPLATE
    system_prompt: str | None = None
    score_pattern: str = DEFAULT_SCORE_PATTERN
    max_tokens: int = 16
    score_range: tuple[float, float] | None = None  # a score outside it is an error
    score_match: str = "unique"  # several scores in one reply: unique | first | last
    batch_size: int = 16
    function: str | None = None
    options: dict[str, Any] = field(default_factory=dict, hash=False)  # fn(sample, **options)
    limits: Limits = field(default_factory=Limits)
    pool: Pool = field(default_factory=Pool)
    retry: Retry = field(default_factory=Retry)
    price: Price | None = None
    budget: Budget | None = None
    source: str = "<memory>"

    @property
    def queue(self) -> str:
        return f"qrq.{self.name}"

    def api_key(self) -> str | None:
        """Read the key from the environment at call time; it never enters a message, and
        from now on this process redacts it wherever a backend's reply quotes it."""
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        remember(key)
        return key

    def missing_api_key(self) -> str | None:
        """Why this process cannot call the backend (its key variable is unset), else None.

        A backend-level problem, not a sample's: `qrq worker` refuses to start on it, and the
        worker side treats it like an open circuit (the work fails over to a sibling).
        """
        if self.api_key_env and not os.environ.get(self.api_key_env):
            return (
                f"{self.source}: backend.api_key_env: environment variable {self.api_key_env} "
                f"(the API key of backend {self.name!r}) is not set in this process"
            )
        return None


@dataclass(frozen=True)
class Route:
    """A reward name a trainer uses: backends that produce the same score, with weights."""

    name: str
    backends: tuple[str, ...]
    weights: tuple[float, ...]
    cache: bool = False
    cache_ttl_s: float = 86400.0


@dataclass(frozen=True)
class Config:
    """Everything qrq.toml and the backend files say."""

    redis_url: str | None
    backends: dict[str, Backend]
    routes: dict[str, Route]
    default_route: str | None = None
    deadline_s: float = 600.0
    fallback_score: float = 0.0
    max_sample_bytes: int = 1 << 20
    result_expires_s: int = 6 * 3600
    visibility_timeout_s: int = 900
    lease_s: float = 15.0  # workers stop calling for a batch this long after its client died
    source: str = "<memory>"
    redis_service_name: str | None = None  # the Sentinel service (master name)
    redis_password_env: str | None = None
    sentinel_password_env: str | None = None

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


class _Table:
    """A TOML table that reports wrong or unknown keys with the file and the key's path.

    A file's tables share one list of problems, so `check` reports them all at once: a wrong
    optional value is noted and its default used; a wrong required one, or one the rest of
    its section depends on, stops that section only (`section`)."""

    def __init__(self, data: Any, source: str, path: str, problems: list[str] | None = None):
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: [{path}] must be a table, got {type(data).__name__}")
        self.data, self.source, self.path = data, source, path
        self.used: set[str] = set()
        self.problems = [] if problems is None else problems

    def note(self, problem: ConfigError) -> None:
        self.problems.append(str(problem))

    def section(self, key: str, parse, *args: Any) -> Any:
        """`parse(table, *args)` on sub-table `key`; on its first hard error, None (noted)."""
        try:
            return parse(self.table(key), *args)
        except ConfigError as exc:
            self.note(exc)
            return None

    def check(self) -> None:
        """Raise one ConfigError listing every problem noted in this file, if any."""
        if self.problems:
            prefix = f"{self.source}: "
            raise ConfigError(prefix + "; ".join(p.removeprefix(prefix) for p in self.problems))

    def where(self, key: str) -> str:
        return f"{self.source}: {self.path}.{key}" if self.path else f"{self.source}: {key}"

    def fail(self, key: str, expected: str) -> ConfigError:
        return ConfigError(f"{self.where(key)}: expected {expected}, got {self.data.get(key)!r}")

    def get(
        self,
        key: str,
        kind: type | tuple[type, ...],
        default: Any = None,
        *,
        expected: str | None = None,
        required: bool = False,
    ) -> Any:
        self.used.add(key)
        if key not in self.data:
            if required:
                raise ConfigError(f"{self.where(key)}: missing (expected {expected or kind})")
            return default
        value = self.data[key]
        wrong_bool = isinstance(value, bool) and bool not in (
            kind if isinstance(kind, tuple) else (kind,))
        if wrong_bool or not isinstance(value, kind):
            problem = self.fail(key, expected or getattr(kind, "__name__", str(kind)))
            if required:
                raise problem
            self.note(problem)
            return default
        return value

    def number(
        self, key: str, default: float | None, *, positive: bool = True, allow_zero: bool = False
    ) -> float | None:
        value = self.get(key, (int, float), default, expected="a number")
        if value is None:
            return None
        if not math.isfinite(value):
            self.note(self.fail(key, "a finite number"))
            return default
        if positive and (value < 0 or (value == 0 and not allow_zero)):
            self.note(self.fail(key, "a positive number" if not allow_zero else "a number >= 0"))
            return default
        return float(value)

    def integer(self, key: str, default: int | None, minimum: int = 1) -> int | None:
        value = self.get(key, int, default, expected=f"an integer >= {minimum}")
        if value is not None and value < minimum:
            self.note(self.fail(key, f"an integer >= {minimum}"))
            return default
        return value

    def table(self, key: str) -> _Table:
        self.used.add(key)
        return _Table(self.data.get(key, {}), self.source, f"{self.path}.{key}".strip("."),
                      self.problems)

    def finish(self) -> None:
        for key in sorted(set(self.data) - self.used):
            self.note(ConfigError(
                f"{self.where(key)}: unknown key (known: {', '.join(sorted(self.used))})"))


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc})") from None


def _limits(t: _Table) -> Limits:
    rpm, tpm = t.number("rpm", None, allow_zero=True), t.number("tpm", None, allow_zero=True)
    limits = Limits(
        rpm=rpm or None,
        tpm=tpm or None,
        max_concurrent=t.integer("max_concurrent", None, minimum=0) or None,
        burst_s=t.number("burst_s", 1.0),
        max_pause_s=t.number("max_pause_s", DEFAULT_MAX_PAUSE_S),
    )
    t.finish()
    return limits


def _pool(t: _Table, kind: str, limits: Limits | None) -> Pool:
    pool_type = t.get("type", str, "prefork" if kind == "function" else "threads")
    if pool_type not in POOLS:
        raise t.fail("type", f"one of {', '.join(POOLS)}")
    rate_limit = t.get("rate_limit", str, None, expected='a Celery rate such as "50/s"')
    if rate_limit is not None and not _RATE_LIMIT.match(rate_limit):
        raise t.fail("rate_limit", 'a Celery rate such as "50/s", "3000/m" or "100/h"')
    default_concurrency = (os.cpu_count() or 2) if pool_type == "prefork" else Pool.concurrency
    calls = t.integer("calls", None)
    sized = calls is None and kind != "function"
    if calls is None:  # a function runs one call per task; else the pool sizes itself
        calls = 1 if kind == "function" else _most_calls(limits or Limits())
    pool = Pool(
        pool_type,
        t.integer("concurrency", default_concurrency),
        rate_limit,
        calls,
        sized,
        memory_limit_mb=t.integer("memory_limit_mb", Pool.memory_limit_mb, minimum=0) or None,
        max_tasks_per_child=t.integer("max_tasks_per_child", Pool.max_tasks_per_child),
        max_memory_per_child_mb=t.integer("max_memory_per_child_mb", None),
    )
    t.finish()
    return pool


def _most_calls(limits: Limits) -> int:
    """The most calls in flight a self-sizing pool may grow to."""
    if limits.max_concurrent:
        return min(limits.max_concurrent, MAX_PROCESS_CALLS)
    return MAX_PROCESS_CALLS if limits.rpm else PROCESS_CALLS


def _retry(t: _Table) -> Retry:
    retry = Retry(
        attempts=t.integer("attempts", Retry.attempts),
        rate_limited_per_attempt=t.integer("rate_limited_per_attempt",
                                           Retry.rate_limited_per_attempt, minimum=0),
        backoff_base_s=t.number("backoff_base_s", Retry.backoff_base_s, allow_zero=True),
        backoff_cap_s=t.number("backoff_cap_s", Retry.backoff_cap_s, allow_zero=True),
        jitter=t.get("jitter", bool, Retry.jitter),
        breaker_threshold=t.integer("breaker_threshold", Retry.breaker_threshold),
        breaker_cooldown_s=t.number("breaker_cooldown_s", Retry.breaker_cooldown_s),
    )
    t.finish()
    return retry


def _numbers(t: _Table, cls: type, default: float | None, **opts: bool):
    """A table of numbers only (`[price]`, `[budget]`): one per field of `cls`."""
    value = cls(*(t.number(f.name, default, **opts) for f in fields(cls)))
    t.finish()
    return value


def _price(t: _Table) -> Price:
    return _numbers(t, Price, 0.0, allow_zero=True)


def _budget(t: _Table) -> Budget:
    budget = _numbers(t, Budget, None)
    if not budget.limits():
        raise ConfigError(f"{t.source}: budget: expected at least one of tokens_per_hour, "
                          "tokens_total, cost_per_hour, cost_total")
    return budget


def load_backend(path: str | os.PathLike[str]) -> Backend:
    """Read one workers/<backend>.toml; every problem in it is reported in one ConfigError."""
    path = Path(path)
    root = _Table(_read_toml(path), str(path), "")
    values = root.section("backend", _backend_values, path)
    raw = root.data.get("backend")
    kind = values["kind"] if values else raw.get("kind") if isinstance(raw, dict) else None
    limits = root.section("limits", _limits)
    pool = root.section("pool", _pool, kind if kind in KINDS else "judge", limits)
    retry = root.section("retry", _retry)
    price = root.section("price", _price) if "price" in root.data else None
    budget = root.section("budget", _budget) if "budget" in root.data else None
    if budget and {"cost_per_hour", "cost_total"} & set(budget.limits()) and price is None:
        root.note(ConfigError(f"{path}: budget: a cost budget needs a [price] table"))
    root.finish()
    root.check()
    return Backend(**values, limits=limits, pool=pool, retry=retry, price=price, budget=budget,
                   source=str(path))


def _backend_values(b: _Table, path: Path) -> dict[str, Any]:
    """The [backend] table of a backend file, as Backend's keyword arguments."""
    kind = b.get("kind", str, required=True, expected=f"one of {', '.join(KINDS)}")
    if kind not in KINDS:
        raise b.fail("kind", f"one of {', '.join(KINDS)}")
    name = b.get("name", str, path.stem)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise b.fail("name", "letters, digits, '.', '_' or '-'")
    values: dict[str, Any] = {
        "name": name,
        "kind": kind,
        "timeout_s": b.number("timeout_s", Backend.timeout_s),
        "api_key_env": _env_name(b),
    }
    if kind in ("judge", "reward_model"):
        values["url"] = expand_env(
            b.get("url", str, required=True, expected="an http(s) URL"), b.where("url")
        )
        if not values["url"].startswith(("http://", "https://")):
            raise b.fail("url", "an http(s) URL")
    if kind == "judge":
        values["model"] = b.get("model", str, required=True, expected="a model name")
        values["prompt_template"] = b.get("prompt_template", str, DEFAULT_TEMPLATE)
        values["system_prompt"] = b.get("system_prompt", str, None)
        values["score_pattern"] = b.get("score_pattern", str, DEFAULT_SCORE_PATTERN)
        values["max_tokens"] = b.integer("max_tokens", Backend.max_tokens)
        try:
            if re.compile(values["score_pattern"]).groups < 1:
                raise b.fail("score_pattern", "a regex with one capture group for the score")
        except re.error as exc:
            raise b.fail("score_pattern", f"a valid regex ({exc})") from None
        _check_template(b, values["prompt_template"])
        values["score_match"] = b.get("score_match", str, "unique")
        if values["score_match"] not in SCORE_MATCHES:
            raise b.fail("score_match", f"one of {', '.join(SCORE_MATCHES)}")
        # the default template asks for a score from 0 to 1
        default_range = (0.0, 1.0) if values["prompt_template"] == DEFAULT_TEMPLATE else None
        values["score_range"] = _score_range(b, default_range)
    elif kind == "reward_model":
        values["model"] = b.get("model", str, None)
        values["batch_size"] = b.integer("batch_size", Backend.batch_size)
        values["score_range"] = _score_range(b, None)
    else:
        values["function"] = b.get(
            "function", str, required=True, expected="an import path 'package.module:callable'"
        )
        if not re.fullmatch(r"[\w.]+:[\w.]+", values["function"]):
            raise b.fail("function", "an import path 'package.module:callable'")
        values["options"] = b.get("options", dict, {}, expected="a table of keyword arguments")
    values["chunk_size"] = b.integer("chunk_size", 16 if kind == "function" else None)
    b.finish()
    return values


def _score_range(t: _Table, default: tuple[float, float] | None) -> tuple[float, float] | None:
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


def _env_name(t: _Table) -> str | None:
    """The NAME of the variable holding the API key; a pasted key is refused unquoted."""
    name = t.get("api_key_env", str, None, expected="the NAME of an environment variable")
    if name is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ConfigError(
            f"{t.where('api_key_env')}: expected the NAME of an environment "
            "variable (letters, digits, '_'), not a key; the value is not shown"
        )
    return name


def _check_template(t: _Table, template: str) -> None:
    fields = {"prompt": "", "response": "", "reference": "", "data_source": "", "extra": {}}
    try:
        template.format(**fields)
    except Exception as exc:  # str.format can raise almost anything on a bad template
        raise t.fail(
            "prompt_template",
            "placeholders among {prompt} {response} {reference} "
            f"{{data_source}} {{extra}} ({exc!r})",
        ) from None


def _routes(t: _Table, backends: dict[str, Backend], broken: Collection[str] = ()
            ) -> dict[str, Route]:
    """The [routes] table; backends of `broken` files are left out of their routes."""
    routes = {}
    for name in list(t.data):
        r = t.table(name)
        names = r.get("backends", list, required=True, expected="a list of backend names")
        if not names or not all(isinstance(n, str) for n in names):
            raise r.fail("backends", "a non-empty list of backend names")
        for n in names:
            if n not in backends and n not in broken:
                raise r.fail(
                    "backends",
                    f"backends defined in the workers directory "
                    f"(no file defines {n!r}; known: {', '.join(sorted(backends))})",
                )
        names = [n for n in names if n not in broken]
        if not names:
            continue
        w = r.table("weights")
        weights = tuple(w.number(n, 1.0) for n in names)
        w.finish()
        routes[name] = Route(
            name=name,
            backends=tuple(names),
            weights=weights,
            cache=r.get("cache", bool, False),
            cache_ttl_s=r.number("cache_ttl_s", 86400.0),
        )
        r.finish()
    return routes


def _redis_settings(t: _Table, env_url: str | None) -> tuple[str | None, dict]:
    """[redis]: `url`, or `sentinels` + `service_name` (+ `db`); password env var names.

    QRQ_REDIS_URL replaces `url`/`sentinels`; a `sentinel://` one takes the service name from
    `service_name` or QRQ_REDIS_SERVICE_NAME."""
    from .redis_conn import is_sentinel, sentinel_addresses, sentinel_url

    url = t.get("url", str, None, expected="a redis://, rediss:// or sentinel:// URL")
    sentinels = t.get("sentinels", list, None, expected='a list of "host:port" strings')
    if url is not None and sentinels is not None:
        raise ConfigError(f"{t.where('sentinels')}: give either url or sentinels, not both")
    if sentinels is not None:
        if not sentinels or not all(isinstance(a, str) and a.strip() for a in sentinels):
            raise t.fail("sentinels", 'a non-empty list of "host:port" strings')
        url = sentinel_url([a.strip() for a in sentinels], t.integer("db", 0, minimum=0))
    where = "QRQ_REDIS_URL" if env_url else t.where("sentinels" if sentinels else "url")
    url = env_url or url
    service = t.get("service_name", str, None, expected="the Sentinel service (master) name")
    target = {
        "redis_service_name": os.environ.get("QRQ_REDIS_SERVICE_NAME") or service,
        "redis_password_env": t.get("password_env", str, None),
        "sentinel_password_env": t.get("sentinel_password_env", str, None),
    }
    if url is None:
        return None, target
    if is_sentinel(url):
        try:
            sentinel_addresses(url)
        except ValueError as exc:
            raise ConfigError(
                f"{where}: {exc} (expected sentinel://h1:26379;sentinel://h2:26379/0)"
            ) from None
        if not target["redis_service_name"]:
            raise ConfigError(
                f"{where} names sentinels but no service: set [redis] service_name "
                "(the sentinels' master name) or QRQ_REDIS_SERVICE_NAME"
            )
    elif not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(
            f"{where}: expected a redis://, rediss:// or sentinel:// URL, got {url!r}"
        )
    return url, target


_FROM_PYTHON = "call qreward_queue.configure(FILE) or set QRQ_CONFIG=FILE"


def config_not_found(how: str = "pass --config FILE or set QRQ_CONFIG=FILE") -> str:
    """Where the default lookup looked, and `how` to point it at a file."""
    return (
        f"no qrq.toml found ($QRQ_CONFIG is unset and there is no {Path.cwd() / 'qrq.toml'}); "
        f"{how} (an example ships with qrq: {PACKAGED_CONFIG})"
    )


def find_config() -> str | None:
    """The qrq.toml the default lookup finds: $QRQ_CONFIG, else ./qrq.toml, else None."""
    path = os.environ.get("QRQ_CONFIG") or None
    if path is None and Path("qrq.toml").exists():
        path = "qrq.toml"
    return path


def load_config(
    path: str | os.PathLike[str] | None = None, broken: dict[str, str] | None = None
) -> Config:
    """Load qrq.toml (argument, else $QRQ_CONFIG, else ./qrq.toml) and its backend files.

    Without any file, the result is an empty embedded configuration. Every problem of one file
    is reported at once. With a `broken` dict (what a worker passes: it needs its own file and
    only the routes of the others), a backend file with problems is left out and its message
    kept there under the file's path, instead of stopping everything.
    """
    path = path or find_config()
    env_url = os.environ.get("QRQ_REDIS_URL") or None
    if path is None:
        url, target = _redis_settings(_Table({}, "environment", "redis"), env_url)
        return Config(redis_url=url, backends={}, routes={}, **target)
    path = Path(path)
    root = _Table(_read_toml(path), str(path), "")
    redis_t = root.table("redis")
    url, target = _redis_settings(redis_t, env_url)
    redis_t.finish()
    d = root.table("defaults")
    workers_dir = path.parent / root.get("workers_dir", str, "workers")
    if not workers_dir.is_dir():
        root.note(ConfigError(f"{path}: workers_dir: no directory {workers_dir}"))
        root.check()
    backends = {}
    for file in sorted(workers_dir.glob("*.toml")):
        try:
            backend = load_backend(file)
        except ConfigError as exc:
            if broken is None:
                raise
            broken[str(file)] = str(exc)
            continue
        if backend.name in backends:
            raise ConfigError(
                f"{file}: backend.name: {backend.name!r} is also defined in "
                f"{backends[backend.name].source}"
            )
        backends[backend.name] = backend
    config = Config(
        redis_url=url,
        backends=backends,
        routes=root.section("routes", _routes, backends,
                            {Path(f).stem for f in broken or {}}) or {},
        default_route=d.get("route", str, None),
        deadline_s=d.number("deadline_s", 600.0),
        fallback_score=d.number("fallback_score", 0.0, positive=False),
        max_sample_bytes=d.integer("max_sample_bytes", 1 << 20),
        result_expires_s=d.integer("result_expires_s", 6 * 3600),
        visibility_timeout_s=d.integer("visibility_timeout_s", 900),
        lease_s=d.number("lease_s", 15.0),
        source=str(path),
        **target,
    )
    d.finish()
    root.finish()
    root.check()
    if config.default_route is not None:
        try:
            config.route(config.default_route)
        except UnknownRoute as exc:
            raise ConfigError(f"{path}: defaults.route: {exc}") from None
    return config
