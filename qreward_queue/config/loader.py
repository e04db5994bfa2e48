"""Load and check qrq.toml and workers/<backend>.toml; every mistake names its file and key.

qrq.toml is found through QRQ_CONFIG (a path), else ./qrq.toml; QRQ_REDIS_URL overrides its
`[redis] url`. With no URL at all qrq runs in embedded mode (in-process broker and workers).
The package ships an example configuration (`defaults/`: the demo's two mock judges, a reward
model and a CPU reward) so that `qrq demo` runs from any directory and from a wheel.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from dataclasses import fields
from pathlib import Path
from typing import Any, overload

from ..backends import KINDS, make_backend
from ..backends.injection import ON_INJECTION
from ..errors import ConfigError, UnknownRoute
from ..flow.ratelimit_headers import DEFAULT_MAX_PAUSE_S
from ..message import job_problem
from ..planning.ensemble import AGGREGATES
from .model import (
    DEFAULT_JOB,
    MAX_PROCESS_CALLS,
    PROCESS_CALLS,
    Audit,
    Backend,
    Budget,
    Config,
    GatewaySettings,
    Jobs,
    JobSettings,
    Limits,
    Pool,
    Price,
    Retry,
    Route,
)
from .toml_table import Table, read_toml

POOLS = ("threads", "prefork", "solo")
_RATE_LIMIT = re.compile(r"^\d+(\.\d+)?/[smh]$")


def _limits(t: Table) -> Limits:
    rpm, tpm = t.number("rpm", None, allow_zero=True), t.number("tpm", None, allow_zero=True)
    limits = Limits(
        rpm=rpm or None,
        tpm=tpm or None,
        max_concurrent=t.integer("max_concurrent", None, minimum=0) or None,
        burst_s=t.number("burst_s", Limits.burst_s),
        max_pause_s=t.number("max_pause_s", DEFAULT_MAX_PAUSE_S),
    )
    t.finish()
    return limits


def _pool(t: Table, local: bool, limits: Limits | None) -> Pool:
    """[pool]; `local`: the kind's calls run on the worker's CPU (see BackendClient)."""
    pool_type = t.get("type", str, "prefork" if local else "threads")
    if pool_type not in POOLS:
        raise t.fail("type", f"one of {', '.join(POOLS)}")
    rate_limit = t.get("rate_limit", str, None, expected='a Celery rate such as "50/s"')
    if rate_limit is not None and not _RATE_LIMIT.match(rate_limit):
        raise t.fail("rate_limit", 'a Celery rate such as "50/s", "3000/m" or "100/h"')
    default_concurrency = (os.cpu_count() or 2) if pool_type == "prefork" else Pool.concurrency
    calls = t.integer("calls", None)
    sized = calls is None and not local
    if calls is None:  # a local call runs one per task; else the pool sizes itself
        calls = 1 if local else _most_calls(limits or Limits())
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


def _retry(t: Table) -> Retry:
    retry = Retry(
        attempts=t.integer("attempts", Retry.attempts),
        rate_limited_per_attempt=t.integer("rate_limited_per_attempt",
                                           Retry.rate_limited_per_attempt, minimum=0),
        backoff_base_s=t.number("backoff_base_s", Retry.backoff_base_s, allow_zero=True),
        backoff_cap_s=t.number("backoff_cap_s", Retry.backoff_cap_s, allow_zero=True),
        jitter=t.get("jitter", bool, Retry.jitter),
        breaker_threshold=t.integer("breaker_threshold", Retry.breaker_threshold),
        breaker_cooldown_s=t.number("breaker_cooldown_s", Retry.breaker_cooldown_s),
        hedge=t.get("hedge", bool, Retry.hedge),
    )
    t.finish()
    return retry


@overload
def _numbers(t: Table, cls: type[Price], default: float, **opts: bool) -> Price: ...
@overload
def _numbers(t: Table, cls: type[Budget], default: None, **opts: bool) -> Budget: ...
def _numbers(t: Table, cls: type[Any], default: float | None, **opts: bool) -> Any:
    """A table of numbers only (`[price]`, `[budget]`): one per field of `cls`."""
    value = cls(*(t.number(f.name, default, **opts) for f in fields(cls)))
    t.finish()
    return value


def _price(t: Table) -> Price:
    return _numbers(t, Price, 0.0, allow_zero=True)


def _budget(t: Table) -> Budget:
    budget = _numbers(t, Budget, None)
    if not budget.limits():
        raise ConfigError(f"{t.source}: budget: expected at least one of tokens_per_hour, "
                          "tokens_total, cost_per_hour, cost_total")
    return budget


def _gateway(t: Table, base: Path) -> GatewaySettings:
    """[gateway]: `keys_env` or `keys_file` (relative to qrq.toml), and `[gateway.budget.<job>]`
    tables of [budget]'s caps."""
    keys_file = t.get("keys_file", str, None, expected="a path")
    budgets = t.table("budget")
    settings = GatewaySettings(
        keys_env=_env_name(t, "keys_env"),
        keys_file=str(base / keys_file) if keys_file else None,
        budgets={job: b for job in list(budgets.data)
                 if (b := budgets.section(job, _budget)) is not None},
    )
    budgets.finish()
    t.finish()
    return settings


def _jobs(t: Table, gateway_budgets: dict[str, Budget]) -> Jobs:
    """[jobs]: `name` (this process's job when it names none), `max_labels`, `fair_shares`,
    and per job
    `[jobs.<job>]` with `weight` and a `[jobs.<job>.budget]` of [budget]'s caps (the older
    `[gateway.budget.<job>]` says the same; a job may not have both)."""
    name = t.get("name", str, DEFAULT_JOB, expected="a job's name")
    if (problem := job_problem(name)) is not None:
        t.note(ConfigError(f"{t.where('name')}: {problem}"))
        name = DEFAULT_JOB
    max_labels = t.integer("max_labels", Jobs.max_labels)
    fair_shares = t.get("fair_shares", bool, True, expected="true or false")
    each: dict[str, JobSettings] = {}
    for job in [k for k in t.data if k not in ("name", "max_labels", "fair_shares")]:
        if (problem := job_problem(job)) is not None:
            t.note(ConfigError(f"{t.where(job)}: {problem}"))
            t.used.add(job)
            continue
        if (settings := t.section(job, _job, gateway_budgets.get(job))) is not None:
            each[job] = settings
    for job, budget in gateway_budgets.items():
        each.setdefault(job, JobSettings(budget=budget))
    t.finish()
    return Jobs(name=name, max_labels=max_labels, fair_shares=fair_shares, each=each)


def _job(t: Table, gateway_budget: Budget | None) -> JobSettings:
    weight = t.number("weight", 1.0)
    budget = t.section("budget", _budget) if "budget" in t.data else None
    if budget is not None and gateway_budget is not None:
        t.note(ConfigError(f"{t.where('budget')}: also set as [gateway.budget.{t.path[5:]}] "
                           "(keep one)"))
    t.finish()
    return JobSettings(weight=weight, budget=budget or gateway_budget)


def load_backend(path: str | os.PathLike[str]) -> Backend:
    """Read one workers/<backend>.toml; every problem in it is reported in one ConfigError."""
    path = Path(path)
    root = Table(read_toml(path), str(path), "")
    values = root.section("backend", _backend_values, path)
    raw = root.data.get("backend")
    kind = values["kind"] if values else raw.get("kind") if isinstance(raw, dict) else None
    limits = root.section("limits", _limits)
    local = kind in KINDS and KINDS[kind].runs_locally
    pool = root.section("pool", _pool, local, limits)
    retry = root.section("retry", _retry)
    price = root.section("price", _price) if "price" in root.data else None
    budget = root.section("budget", _budget) if "budget" in root.data else None
    if budget and {"cost_per_hour", "cost_total"} & set(budget.limits()) and price is None:
        root.note(ConfigError(f"{path}: budget: a cost budget needs a [price] table"))
    root.finish()
    root.check()
    return Backend(**values, limits=limits, pool=pool, retry=retry, price=price, budget=budget,
                   source=str(path))


def _backend_values(b: Table, path: Path) -> dict[str, Any]:
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
    values["options"] = KINDS[kind].read_options(b)
    values["chunk_size"] = b.integer("chunk_size", KINDS[kind].default_chunk_size)
    b.finish()
    return values


def _env_name(t: Table, key: str = "api_key_env") -> str | None:
    """The NAME of the variable holding an API key; a pasted key is refused unquoted."""
    name: str | None = t.get(key, str, None, expected="the NAME of an environment variable")
    if name is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ConfigError(
            f"{t.where(key)}: expected the NAME of an environment "
            "variable (letters, digits, '_'), not a key; the value is not shown"
        )
    return name


def _routes(t: Table, backends: dict[str, Backend], broken: Collection[str] = ()
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
        modes = sorted({"group" if make_backend(backends[n]).grouped else "sample"
                        for n in names})
        if len(modes) > 1:  # a group score and a sample score are not the same reward
            raise r.fail("backends", f'backends of one mode (these mix {" and ".join(modes)})')
        w = r.table("weights")
        weights = tuple(w.number(n, 1.0) for n in names)
        w.finish()
        routes[name] = Route(
            name=name,
            backends=tuple(names),
            weights=weights,
            cache=r.get("cache", bool, False),
            cache_ttl_s=r.number("cache_ttl_s", Route.cache_ttl_s),
            **_ensemble(r, modes),
            **_integrity(r),
        )
        r.finish()
    for name, route in routes.items():
        audit = route.audit
        if audit and (audit.route == name or audit.route not in {*routes, *backends}):
            raise t.table(name).table("audit").fail(
                "route", f"another route or backend (known: {', '.join(sorted(routes))})")
    return routes


def _integrity(r: Table) -> dict[str, Any]:
    """`on_injection` and the `audit` lane of a route (backends/injection.py, ops/audit.py)."""
    how = r.get("on_injection", str, "score")
    if how not in ON_INJECTION:
        raise r.fail("on_injection", f"one of {', '.join(ON_INJECTION)}")
    if "audit" not in r.data:
        return {"on_injection": how}
    a = r.table("audit")
    fraction = a.number("fraction", 0.02)
    if not 0 < fraction <= 1:
        raise a.fail("fraction", "a number in (0, 1]")
    audit = Audit(route=a.get("route", str, required=True, expected="a route or backend name"),
                  fraction=fraction,
                  threshold=a.number("threshold", Audit.threshold, positive=False),
                  seed=a.integer("seed", Audit.seed, minimum=0))
    a.finish()
    return {"on_injection": how, "audit": audit}


def _ensemble(r: Table, modes: list[str]) -> dict[str, Any]:
    """`votes`, `aggregate`, `quorum`, `temperature` of a route (none: not an ensemble)."""
    if "votes" not in r.data:
        for key in ("aggregate", "quorum", "temperature"):
            if key in r.data:
                r.used.add(key)
                r.note(ConfigError(f"{r.where(key)}: only read with votes = k"))
        return {}
    votes = r.integer("votes", None)
    if votes is None:
        raise r.fail("votes", "an integer >= 1")
    if "group" in modes:
        raise r.fail("votes", "no votes over judges in group mode (a group is one question)")
    how = r.get("aggregate", str, "mean")
    if how not in AGGREGATES:
        raise r.fail("aggregate", f"one of {', '.join(AGGREGATES)}")
    quorum = r.integer("quorum", votes // 2 + 1)  # default: a majority of the votes
    if quorum > votes:
        raise r.fail("quorum", f"an integer from 1 to votes ({votes})")
    temperature = r.number("temperature", Route.temperature, allow_zero=True)
    return {"votes": votes, "aggregate": how, "quorum": quorum, "temperature": temperature}


def _redis_settings(t: Table, env_url: str | None) -> tuple[str | None, dict[str, Any]]:
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
        url, target = _redis_settings(Table({}, "environment", "redis"), env_url)
        return Config(redis_url=url, backends={}, routes={}, **target)
    path = Path(path)
    root = Table(read_toml(path), str(path), "")
    redis_t = root.table("redis")
    url, target = _redis_settings(redis_t, env_url)
    redis_t.finish()
    d = root.table("defaults")
    workers_dir = path.parent / root.get("workers_dir", str, "workers")
    if not workers_dir.is_dir():
        root.note(ConfigError(f"{path}: workers_dir: no directory {workers_dir}"))
        root.check()
    backends: dict[str, Backend] = {}
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
    gateway = root.section("gateway", _gateway, path.parent) or GatewaySettings()
    config = Config(
        redis_url=url,
        backends=backends,
        routes=root.section("routes", _routes, backends,
                            {Path(f).stem for f in broken or {}}) or {},
        default_route=d.get("route", str, None),
        deadline_s=d.number("deadline_s", Config.deadline_s),
        fallback_score=d.number("fallback_score", Config.fallback_score, positive=False),
        max_sample_bytes=d.integer("max_sample_bytes", Config.max_sample_bytes),
        result_expires_s=d.integer("result_expires_s", Config.result_expires_s),
        visibility_timeout_s=d.integer("visibility_timeout_s", Config.visibility_timeout_s),
        lease_s=d.number("lease_s", Config.lease_s),
        source=str(path),
        gateway=gateway,
        jobs=root.section("jobs", _jobs, gateway.budgets) or Jobs(),
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
