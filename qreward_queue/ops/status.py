"""`qrq status`: what each backend's queue and limiter look like right now, and its spend."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable

from ..broker.app import QrqCelery
from ..config.model import Config
from ..flow.limiter import CLAIM_WINDOW_S, CORROBORATE
from ..flow.spend import backend_spend
from ..planning.capacity import QueuedSamples, queue_depth, queue_depths
from ..priority import Priority
from . import audit
from .job_spend import job_rows
from .liveness import call_pools, live_workers
from .plan import samples_per_call

LOOK_S = 1.0  # `qrq status` measures samples/s over this long


def backend_rows(app: QrqCelery) -> list[dict]:
    """One row per backend: queue depth plus the limiter's view (levels, leases, AIMD, 429s)
    and its spend (total, this hour, each budget cap's use and what is left)."""
    rows = []
    for name, backend in app.qrq_config.backends.items():
        limiter = app.flow.limiter(name)
        nodes = live_workers(app.store, backend.queue)
        row = {
            "backend": name,
            "kind": backend.kind,
            "queued": queue_depth(app.store, backend.queue),
            "workers": len(nodes),
            "calls": call_pools(app.store, nodes, name),
            "spend": backend_spend(app.store, backend),
        }
        row.update(limiter.status() if limiter else {})
        rows.append(row)
    return rows


def snapshot(app: QrqCelery, previous: dict | None = None) -> dict:
    """Everything `qrq status --json` prints: per backend the rows above plus the samples
    queued (the planner's count, `capacity.QueuedSamples`), tasks by priority, breaker state,
    the rate limit in samples/s and the ETA of what is queued.

    With the `previous` snapshot, `samples_per_s` is how fast the backend's calls scored
    samples since then, `drain_per_s` how fast the queue emptied, and the ETA uses the
    faster; otherwise the ETA assumes the backend runs at its rate limit."""
    now = time.time()
    before = {b["backend"]: b for b in (previous or {}).get("backends", [])}
    rows = backend_rows(app)
    counts = QueuedSamples(app.store)
    for row in rows:
        backend = app.backend_config(row["backend"])
        per_call = samples_per_call(backend)
        depths = queue_depths(app.store, backend.queue)
        row["queued_by_priority"] = {Priority.name_of(level): n
                                     for level, n in depths.items() if n}
        row["queued_samples"] = counts.read(backend.queue)
        row["breaker"] = app.flow.breaker(row["backend"]).state()
        rpm = row.get("limits", {}).get("rpm", {}).get("per_minute")
        row["limit_samples_per_s"] = rpm / 60 * per_call if rpm else None
        prev = before.get(row["backend"])
        drain = scored = None
        if prev is not None and previous is not None and now > previous["time"]:
            elapsed = now - previous["time"]
            drain = (prev["queued_samples"] - row["queued_samples"]) / elapsed
            calls = row["spend"]["total"]["calls"] - prev["spend"]["total"]["calls"]
            scored = max(0, calls) * per_call / elapsed
        row["drain_per_s"], row["samples_per_s"] = drain, scored
        speed = max(drain or 0, scored or 0) or row["limit_samples_per_s"]
        row["eta_s"] = 0.0 if not row["queued_samples"] else \
            row["queued_samples"] / speed if speed else None
    audits = {r.name: audit.hours(app.store, r.name) for r in app.qrq_config.routes.values()
              if r.audit}
    return {"time": now, "backends": rows, "jobs": job_rows(app.store, app.qrq_config),
            "audits": audits}


def _fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def render_snapshot(snap: dict) -> str:
    """One line per backend, as `qrq status` and `qrq status --watch` show it."""
    lines = [
        f"{'backend':<14}{'kind':<13}{'samples':>8}{'/s':>7}{'workers':>8}"
        f" {'tasks ' + '/'.join(Priority):>21}"
        f"{'rpm now/cfg':>14}"
        f"{'tpm level/cap':>16}{'leases':>8}{'adapt':>6}{'429s/60s':>9}{'paused':>7}"
        f"{'breaker':>10}{'eta_s':>7}"
    ]
    for row in snap["backends"]:
        limits = row.get("limits", {})
        rpm, tpm = limits.get("rpm"), limits.get("tpm")
        by = row["queued_by_priority"]
        split = "/".join(str(by.get(p, 0)) for p in Priority)
        rate = f"{rpm['per_minute']:.0f}/{rpm['configured_per_minute']:.0f}" if rpm else "-"
        level = f"{tpm['level']:.0f}/{tpm['capacity']:.0f}" if tpm else "-"
        leases = f"{row.get('leases_in_use', 0)}/{row.get('max_concurrent') or '-'}"
        lines.append(
            f"{row['backend']:<14}{row['kind']:<13}{row['queued_samples']:>8}"
            f"{_fmt(row['samples_per_s'], '.1f'):>7}{row['workers']:>8} "
            f"{split:>21}{rate:>14}"
            f"{level:>16}{leases:>8}{row.get('adaptive_limit') or '-':>6}"
            f"{row.get('recent_429s', 0):>9}{row.get('paused_for_s', 0.0):>6.1f}s"
            f"{row['breaker']:>10}{_fmt(row['eta_s'], '.1f'):>7}"
        )
    lines += [f"  {row['backend']}: a reply out of bounds (last 10 min): {row['bounded']}"
              for row in snap["backends"] if row.get("bounded")]
    lines += [line for row in snap["backends"] for line in _learned_lines(row)]
    lines += [f"  {row['backend']}: adaptive concurrency {row['adaptive_why']}"
              for row in snap["backends"] if row.get("adaptive_why")]
    lines += [f"  {row['backend']}: {node} keeps {pool['calls']} calls in flight ({pool['why']})"
              for row in snap["backends"] for node, pool in row.get("calls", {}).items()]
    for row in snap["backends"]:
        lines += render_spend(row["backend"], row["spend"])
    for job in snap.get("jobs", []):  # ops/job_spend.py
        spent = render_spend(f"job {job['job']}", job)
        if spent:
            spent[0] += (f" ({job['share']:.1%} of the jobs' calls; weight {job['weight']:g}; "
                         f"{job['queued']:,} samples queued)")
        lines += spent
    for route, hours in snap.get("audits", {}).items():
        lines += audit.render(route, hours)
    return "\n".join(lines)


def _learned_lines(row: dict) -> list[str]:
    """What replies said of a limit below the configured one, and whether it was believed."""
    lines = []
    for name, lim in row.get("limits", {}).items():
        learned = lim.get("learned")
        if not learned:
            continue
        told = f"{learned['told_per_minute']:.6g}/min"
        heard = f"{learned['replies']} reply(s), last {learned['age_s']:.0f} s ago"
        if learned["believed"]:
            lines.append(
                f"  {row['backend']}: {name} limit {told} believed ({learned['by']}; {heard}); "
                f"now {lim['per_minute']:.6g}/min, doubling back towards the configured "
                f"{lim['configured_per_minute']:.6g}/min unless replies confirm it")
        else:
            lines.append(
                f"  {row['backend']}: {name} limit {told} told ({heard}), not believed: it "
                f"takes {CORROBORATE} agreeing replies within {CLAIM_WINDOW_S:g} s of each "
                "other, or a 429 saying it")
    return lines


def render_spend(backend: str, spend: dict) -> list[str]:
    """`<backend>: spent ...` and one line per budget cap (nothing for a backend never used)."""
    total, hour = spend["total"], spend["this_hour"]
    if not total["calls"] and not spend["budgets"]:
        return []

    def figures(f: dict) -> str:
        estimated = f" ({f['estimated_calls']:,} estimated)" if f["estimated_calls"] else ""
        return (f"{f['calls']:,} calls, {f['tokens_in']:,} tokens in, "
                f"{f['tokens_out']:,} out{estimated}, cost {f['cost']:.4f}")

    lines = [f"  {backend}: spent {figures(total)}; this hour {figures(hour)}"]
    lines += [f"  {backend}: budget {cap} {b['limit']:,g}: {b['used']:,g} used, "
              f"{b['left']:,g} left" for cap, b in spend["budgets"].items()]
    return lines


def render_status(config: Config, as_json: bool = False) -> str:
    if config.embedded:
        return "embedded mode keeps no shared state between processes; set QRQ_REDIS_URL"
    app = QrqCelery(config)
    first = snapshot(app)
    time.sleep(LOOK_S)  # samples/s is measured over a short look, as `top` does
    snap = snapshot(app, first)
    return json.dumps(snap) if as_json else render_snapshot(snap)


def watch(config: Config, interval_s: float, echo: Callable[[str], None]) -> None:
    """Redraw the status every `interval_s` until interrupted (Ctrl-C)."""
    app, previous = QrqCelery(config), None
    with contextlib.suppress(KeyboardInterrupt):
        while True:
            snap = snapshot(app, previous)
            echo("\x1b[H\x1b[2J" + time.strftime("qrq status --watch  %H:%M:%S  ")
                 + f"(every {interval_s:g} s, Ctrl-C quits)\n" + render_snapshot(snap))
            previous = snap
            time.sleep(interval_s)
