"""`qrq plan`: predict a reward step's wall time from the backend files, and what binds it.

Why: the limits in workers/*.toml, the pool sizes and the backend's latency fix the best
throughput each backend can reach; the route spreads a batch in proportion to weight x
capacity, so the step takes as long as its slowest share. Per backend the rate in calls/s is
the smallest of

    rpm             rpm / 60
    tpm             tpm / 60 / tokens per call (prompt after the template + max_tokens)
    concurrency     max_concurrent / latency
    worker calls    workers x pool calls / latency              (calls in flight per process;
                                                                for functions its processes)
    CPU             cores / CPU seconds per call                (functions: cores of their pool)

and the step takes calls / rate + one latency. A plan never promises more than a limit
allows: the burst a full bucket admits at once is not counted (the demo's limiter, its bucket
drained by the clients before it, measured the limit's rate; benchmarks/plan_check.py).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

from ..backends import make_backend
from ..config.model import Backend, Config

SERVICE_LIMITS = ("rpm", "tpm", "concurrency")  # the service sets these; we cannot raise them


@dataclass(frozen=True)
class Workload:
    """What one reward step sends: `n` samples of these mean sizes, and the backend's speed."""

    n: int
    prompt_tokens: float = 256
    response_tokens: float = 512
    latency_s: float = 1.0  # one HTTP backend call
    cpu_s_per_sample: float = 0.001  # function backends
    cpu_s_per_call: float = 0.003  # qrq's own CPU around one HTTP call (measured: 1-5.4 ms)
    workers: dict[str, int] = field(default_factory=dict)  # backend -> worker processes (1)
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    measured_latency_s: dict[str, float] = field(default_factory=dict)  # backend -> from metrics
    group_size: int = 8  # responses per prompt (a GRPO group): a group-mode judge's call

    def latency(self, backend: str) -> float:
        """The backend's measured mean latency if known, else `latency_s`."""
        return self.measured_latency_s.get(backend, self.latency_s)


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
    advice: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {**asdict(self), "samples_per_s": round(self.n / self.wall_s, 2)}


def one_call(backend: Backend, work: Workload | None = None) -> list[dict]:
    """The samples of one call of the workload, as the backend's kind splits a batch into
    calls (a judge: 1, a reward model: its batch, a function: its chunk, a judge in group
    mode: a GRPO group of `group_size`, split by its `group_max`)."""
    work = work or Workload(1)
    client = make_backend(backend)  # groups of `group_size` responses to one prompt each
    count = max(client.samples_per_call, work.group_size)
    prompt, response = ("x" * round(4 * t) for t in (work.prompt_tokens, work.response_tokens))
    samples = [{"prompt": f"{i // work.group_size:08d}{prompt[8:]}", "response": response}
               for i in range(count)]
    return [samples[i] for i in client.split(samples)[0]]


def samples_per_call(backend: Backend, work: Workload | None = None) -> int:
    """Samples one backend call scores, as its kind says (see `one_call`)."""
    return len(one_call(backend, work))


def runs_locally(backend: Backend) -> bool:
    """Its calls run on the worker's CPU (a function): CPU-bound, its processes are its calls."""
    return make_backend(backend).runs_locally


def tokens_per_call(backend: Backend, work: Workload) -> int:
    """What the limiter books (and OpenAI-style servers charge), as the backend's kind
    estimates it for one call of samples of the workload's mean sizes (whole tokens)."""
    return math.ceil(make_backend(backend).estimate_tokens(one_call(backend, work)))


def cpu_s_per_call(backend: Backend, work: Workload) -> float:
    """Worker CPU one call costs: the function itself, or qrq's own work around an HTTP call."""
    if runs_locally(backend):
        return work.cpu_s_per_sample * samples_per_call(backend, work)
    return work.cpu_s_per_call


def backend_rates(backend: Backend, work: Workload) -> tuple[dict[str, float], int | None]:
    """Calls/s each of this backend's own limits allows (the shared CPU comes later)."""
    limits, pool = backend.limits, backend.pool
    rates: dict[str, float] = {}
    tokens = tokens_per_call(backend, work) if limits.tpm else None
    if limits.rpm:
        rates["rpm"] = limits.rpm / 60
    if limits.tpm and tokens:
        rates["tpm"] = limits.tpm / 60 / tokens
    local = runs_locally(backend)
    if limits.max_concurrent and not local:
        rates["concurrency"] = limits.max_concurrent / work.latency(backend.name)
    busy_s = cpu_s_per_call(backend, work) if local else work.latency(backend.name)
    # calls in flight per worker: its call pool for HTTP backends, its processes for functions
    per_worker = pool.concurrency if local else pool.calls
    rates["worker calls"] = work.workers.get(backend.name, 1) * per_worker / busy_s
    return rates, tokens


def plan_route(config: Config, route_name: str | None, work: Workload,
               target_s: float | None = None) -> Plan:
    """Predict the step's wall time on `route_name` and, with `target_s`, what would meet it.

    The workers of a route share `work.cores`: when the backends' rates together need more
    CPU than that, every rate shrinks in proportion and CPU is the binding limit."""
    route = config.route(route_name)
    members = [config.backend(b) for b in route.backends]
    rated = [backend_rates(b, work) for b in members]
    speed = [min(rates.values()) for rates, _ in rated]
    cpu_load = sum(r * cpu_s_per_call(b, work) for b, r in zip(members, speed, strict=True))
    if cpu_load > work.cores:
        speed = [r * work.cores / cpu_load for r in speed]
        for (rates, _), r in zip(rated, speed, strict=True):
            rates["CPU"] = r
    capacity = [w * r * samples_per_call(b, work)
                for b, w, r in zip(members, route.weights, speed, strict=True)]
    # an ensemble sends each sample to its judges (vote j to backend j mod n), not a share
    shares = [work.n * sum(route.backends[j % len(members)] == b.name for j in range(route.votes))
              for b in members] if route.votes else \
        [round(work.n * cap / sum(capacity)) for cap in capacity]
    plans = []
    for b, (rates, tokens), share in zip(members, rated, shares, strict=True):
        per_call = samples_per_call(b, work)
        calls = math.ceil(share / per_call)
        binding = min(rates, key=rates.__getitem__)
        plans.append(BackendPlan(b.name, share, calls, per_call, tokens, rates,
                                 binding, _wall_s(b, calls, rates[binding], work)))
    plan = Plan(route.name, work.n, max(p.wall_s for p in plans), plans, target_s)
    if target_s is not None and plan.wall_s > target_s:
        plan.advice = advise(members, plan, work, target_s)
    return plan


def _wall_s(backend: Backend, calls: int, rate: float, work: Workload) -> float:
    """calls / rate plus the last call's time: never faster than the binding limit allows."""
    last = cpu_s_per_call(backend, work) if runs_locally(backend) else work.latency(backend.name)
    return calls / rate + last


def advise(members: list[Backend], plan: Plan, work: Workload, target_s: float) -> list[str]:
    """What to change so the step finishes within `target_s`, keeping the route's split.

    Pool size and cores are ours to raise; rpm, tpm and max_concurrent are the service's, so
    a backend held by them needs a sibling backend to take the rest of the load."""
    advice, cores_needed, short = [], 0.0, 0.0
    for b, p in zip(members, plan.backends, strict=True):
        fixed = p.wall_s - p.calls / p.calls_per_s
        need = p.calls / max(target_s - fixed, 1e-3)  # calls/s this share needs
        ceiling = min((r for k, r in p.rates.items() if k in SERVICE_LIMITS), default=math.inf)
        if ceiling < need:
            short += (need - ceiling) * p.samples_per_call
            name = min((k for k in p.rates if k in SERVICE_LIMITS), key=p.rates.__getitem__)
            advice.append(f"{b.name}: {name} caps it at {ceiling * p.samples_per_call:.1f} "
                          f"samples/s, {need * p.samples_per_call:.1f} needed")
        reach = min(need, ceiling)
        cores_needed += reach * cpu_s_per_call(b, work)
        calls = p.rates["worker calls"]
        knob = "concurrency" if runs_locally(b) else "calls"
        if calls < reach:
            workers = work.workers.get(b.name, 1)
            per_worker = calls / workers
            advice.append(f"{b.name}: run {math.ceil(reach / per_worker)} workers "
                          f"(now {workers}) or raise [pool] {knob} to "
                          f"{math.ceil(getattr(b.pool, knob) * reach / calls)}")
    if cores_needed > work.cores:
        advice.append(f"CPU: the workers need {math.ceil(cores_needed)} cores "
                      f"(have {work.cores}): add worker machines")
    if short:
        advice.append(f"add a backend to route {plan.route} that scores {short:.1f} more "
                      f"samples/s (a judge: {short * 60:,.0f} rpm)")
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
        verdict = "meets" if plan.wall_s <= plan.target_s else "misses"
        lines.append(f"target {plan.target_s:g} s: {verdict} it")
        lines += [f"  - {a}" for a in plan.advice]
    return "\n".join(lines)
