"""`qrq plan`: predict a reward step's wall time from the backend files, and what binds it.

Why: the limits in workers/*.toml, the pool sizes and the backend's latency fix the best
throughput each backend can reach; the route spreads a batch in proportion to weight x
capacity, so the step takes as long as its slowest share. Per backend the rate in calls/s is
the smallest of

    rpm             rpm / 60
    tpm             tpm / 60 / tokens per call (prompt after the template + max_tokens)
    concurrency     max_concurrent / latency
    worker threads  workers x pool concurrency / latency        (threads: waiting on I/O)
    CPU             cores / CPU seconds per call                (functions: cores of their pool)

and the step takes calls / rate + one latency, less the calls the bucket's burst admits at
once (the limiter's buckets start full).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

from .config import Backend, Config
from .limiter import estimate_tokens

HTTP_CPU_S_PER_CALL = 0.011  # qrq worker CPU per judge request (README: 9.6-12.1 ms measured)


@dataclass(frozen=True)
class Workload:
    """What one reward step sends: `n` samples of these mean sizes, and the backend's speed."""

    n: int
    prompt_tokens: float = 256
    response_tokens: float = 512
    latency_s: float = 1.0  # one backend call (HTTP) or one chunk of a function (CPU)
    cpu_s_per_sample: float = 0.001  # function backends
    workers: dict[str, int] = field(default_factory=dict)  # backend -> worker processes (1)
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)


@dataclass
class BackendPlan:
    """One backend's share of the step, the limits on its rate, and the binding one."""

    backend: str
    samples: int
    calls: int
    samples_per_call: int
    tokens_per_call: int | None
    rates: dict[str, float]  # limit name -> calls/s it allows
    binding: str
    wall_s: float
    advice: list[str] = field(default_factory=list)

    @property
    def calls_per_s(self) -> float:
        return self.rates[self.binding]


@dataclass
class Plan:
    route: str
    n: int
    wall_s: float
    backends: list[BackendPlan]
    target_s: float | None = None

    def to_dict(self) -> dict:
        return {**asdict(self), "samples_per_s": round(self.n / self.wall_s, 2)}


def samples_per_call(backend: Backend) -> int:
    """Samples one backend call scores: a judge 1, a reward model its batch, a function a chunk."""
    return {"judge": 1, "reward_model": backend.batch_size}.get(backend.kind, backend.chunk_size)


def tokens_per_call(backend: Backend, work: Workload) -> int:
    """What the limiter books (and OpenAI-style servers charge): input tokens + max_tokens."""
    filler = {k: "x" * round(4 * t) for k, t in (("prompt", work.prompt_tokens),
                                                 ("response", work.response_tokens))}
    if backend.kind == "judge":
        text = backend.prompt_template.format(reference="", data_source="", extra="", **filler)
        text += backend.system_prompt or ""
        return estimate_tokens(text, backend.max_tokens)
    return samples_per_call(backend) * estimate_tokens(filler["prompt"] + filler["response"])


def backend_rates(backend: Backend, work: Workload) -> tuple[dict[str, float], int | None]:
    """Calls/s each limit allows for this backend (only the limits that exist)."""
    limits, pool = backend.limits, backend.pool
    workers = work.workers.get(backend.name, 1)
    rates: dict[str, float] = {}
    tokens = tokens_per_call(backend, work) if limits.tpm else None
    if limits.rpm:
        rates["rpm"] = limits.rpm / 60
    if limits.tpm and tokens:
        rates["tpm"] = limits.tpm / 60 / tokens
    if backend.kind == "function":
        cpu_s = work.cpu_s_per_sample * samples_per_call(backend)
        rates["worker threads"] = workers * pool.concurrency / cpu_s
        rates["CPU"] = work.cores / cpu_s
    else:
        if limits.max_concurrent:
            rates["concurrency"] = limits.max_concurrent / work.latency_s
        rates["worker threads"] = workers * pool.concurrency / work.latency_s
        rates["CPU"] = work.cores / HTTP_CPU_S_PER_CALL
    return rates, tokens


def plan_route(config: Config, route_name: str | None, work: Workload,
               target_s: float | None = None) -> Plan:
    """Predict the step's wall time on `route_name` and, with `target_s`, what would meet it."""
    route = config.route(route_name)
    members = [config.backend(b) for b in route.backends]
    rated = [(b, w, *backend_rates(b, work)) for b, w in zip(members, route.weights, strict=True)]
    capacity = [w * min(rates.values()) * samples_per_call(b) for b, w, rates, _ in rated]
    plans = []
    for (b, _, rates, tokens), cap in zip(rated, capacity, strict=True):
        share = round(work.n * cap / sum(capacity))
        per_call = samples_per_call(b)
        calls = math.ceil(share / per_call)
        binding = min(rates, key=rates.__getitem__)
        plans.append(BackendPlan(b.name, share, calls, per_call, tokens, rates, binding,
                                 _wall_s(b, calls, binding, rates[binding], work)))
    plan = Plan(route.name, work.n, max(p.wall_s for p in plans), plans, target_s)
    if target_s is not None:
        for b, p in zip(members, plans, strict=True):
            p.advice = advise(b, p, work, target_s)
    return plan


def _wall_s(backend: Backend, calls: int, binding: str, rate: float, work: Workload) -> float:
    """calls / rate, less the calls a full bucket admits at once, plus the last call's time."""
    burst = min(rate * backend.limits.burst_s, calls) if binding in ("rpm", "tpm") else 0
    last = (work.cpu_s_per_sample * samples_per_call(backend) if backend.kind == "function"
            else work.latency_s)
    return (calls - burst) / rate + last


def advise(backend: Backend, p: BackendPlan, work: Workload, target_s: float) -> list[str]:
    """What to change so this backend's share finishes within `target_s`."""
    if p.wall_s <= target_s:
        return []
    last = p.wall_s - p.calls / p.calls_per_s  # the fixed part: latency less the burst
    need = p.calls / max(target_s - last, 1e-3)  # calls/s required
    advice = []
    threads = backend.pool.concurrency
    for limit, rate in sorted(p.rates.items(), key=lambda kv: kv[1]):
        if rate >= need:
            break
        if limit == "worker threads":
            per_worker = rate / work.workers.get(backend.name, 1)
            workers = math.ceil(need / per_worker)
            advice.append(f"{backend.name}: run {workers} workers of {threads} threads "
                          f"(or raise [pool] concurrency to {math.ceil(threads * need / rate)})")
        elif limit == "CPU":
            per_core = rate / work.cores
            advice.append(f"{backend.name}: needs {math.ceil(need / per_core)} cores "
                          f"(has {work.cores}): add worker machines")
        else:
            missing = (need - rate) * (60 if limit in ("rpm", "tpm") else work.latency_s)
            if limit == "tpm":
                missing *= p.tokens_per_call or 1
            unit = {"rpm": "rpm", "tpm": "tpm", "concurrency": "concurrent calls"}[limit]
            advice.append(f"{backend.name}: {limit} caps it at {rate * p.samples_per_call:.1f} "
                          f"samples/s; add a backend to the route with {missing:,.0f} more {unit}")
    return advice


def render_plan(plan: Plan) -> str:
    """The table `qrq plan` prints."""
    lines = [f"route {plan.route}: {plan.n} samples -> predicted wall time {plan.wall_s:.1f} s "
             f"({plan.n / plan.wall_s:.1f} samples/s)",
             f"{'backend':<16}{'samples':>8}{'calls':>7}{'calls/s':>9}{'wall_s':>8}  "
             f"{'binding':<15}limits (calls/s)"]
    for p in plan.backends:
        others = ", ".join(f"{k} {v:.1f}" for k, v in sorted(p.rates.items(), key=lambda kv: kv[1]))
        lines.append(f"{p.backend:<16}{p.samples:>8}{p.calls:>7}{p.calls_per_s:>9.1f}"
                     f"{p.wall_s:>8.1f}  {p.binding:<15}{others}")
    if plan.target_s is not None:
        advice = [a for p in plan.backends for a in p.advice]
        verdict = "meets" if plan.wall_s <= plan.target_s else "misses"
        lines.append(f"target {plan.target_s:g} s: {verdict} it")
        lines += [f"  - {a}" for a in advice]
    return "\n".join(lines)
