"""`qrq exporter`: qrq's shared state in Redis, read for every Prometheus scrape.

One exporter reads what every worker and client share (queues, leases, the adaptive limit,
the breaker, spend, cache use), so nothing is counted once per worker; the workers' own
counters are `metrics.py`'s. Needs the `metrics` extra (prometheus_client).

Metrics (labels):
    qrq_queue_depth{backend,priority}              messages waiting, per priority level
    qrq_leases_in_use{backend}, qrq_max_concurrent{backend}, qrq_adaptive_limit{backend}
    qrq_rate_limit_per_minute{backend,limit}       the limiter's current rate (rpm, tpm)
    qrq_bucket_level{backend,limit}                tokens left in the bucket (negative: booked)
    qrq_recent_429s{backend}, qrq_paused_seconds{backend}
    qrq_breaker_state{backend}                     0 closed, 1 half-open, 2 open
    qrq_workers_alive                              worker nodes with a fresh heartbeat
    qrq_cache_lookups_total{route}, qrq_cache_hits_total{route}
    qrq_spend_calls_total{backend}                 calls made (every worker, all time)
    qrq_spend_tokens_total{backend,direction}      their tokens, direction in | out
    qrq_spend_estimated_calls_total{backend}       calls whose reply gave no usage (estimated)
    qrq_spend_cost_total{backend}                  their cost, with a [price] in the backend file
    qrq_budget_limit{backend,cap}, qrq_budget_used{backend,cap}   each [budget] cap and its use
    qrq_job_calls_total{job}, qrq_job_tokens_total{job,direction}, qrq_job_cost_total{job}
                                                   each job's spend (jobs beyond [jobs]
                                                   max_labels are summed as `other`)
    qrq_job_samples_queued{job}                    a job's samples waiting in the queues
    qrq_audit_samples{route,audit}, qrq_audit_mean_abs_diff{route,audit},
    qrq_audit_flip_rate{route,audit}, qrq_audit_bias{route,audit}
                                                   an audited route's agreement, this UTC hour
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .. import keys
from ..broker.app import QrqCelery
from ..config.extras import require
from ..planning.capacity import queue_depths
from ..priority import Priority
from . import audit
from .job_spend import job_rows
from .metrics_http import LOCAL, serve_metrics
from .status import backend_rows

BREAKER_STATES = {"closed": 0, "half-open": 1, "open": 2}
OTHER_JOB = "other"  # the label of the jobs beyond [jobs] max_labels
LIMIT_UNITS = {"rpm": "requests", "tpm": "tokens"}  # what each limiter limit counts
BUDGET_CAPS = {"tokens_per_hour": ("tokens", "hour"), "tokens_total": ("tokens", "total"),
               "cost_per_hour": ("cost", "hour"), "cost_total": ("cost", "total")}


class RedisStateCollector:
    """A prometheus_client collector that reads qrq's shared state from Redis per scrape."""

    def __init__(self, app: QrqCelery):
        self.app = app

    def describe(self) -> list:
        return []  # not known before a scrape; keeps registration from calling collect()

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        app = self.app
        g = {name: GaugeMetricFamily(f"qrq_{name}", doc, labels=labels) for name, doc, labels in (
            ("queue_depth", "Messages waiting in a backend's queue", ["backend", "priority"]),
            ("leases_in_use", "Concurrency leases held now", ["backend"]),
            ("max_concurrent", "Configured concurrency limit", ["backend"]),
            ("adaptive_limit", "Concurrency limit the AIMD controller allows now", ["backend"]),
            ("limit_requests_per_second", "Requests per second the limiter enforces now",
             ["backend"]),
            ("limit_tokens_per_second", "Tokens per second the limiter enforces now", ["backend"]),
            ("bucket_requests", "Requests left in the rpm bucket (negative: booked ahead)",
             ["backend"]),
            ("bucket_tokens", "Tokens left in the tpm bucket (negative: booked ahead)",
             ["backend"]),
            ("rate_limit_per_minute", "Deprecated (one release): qrq_limit_requests_per_second "
             "and qrq_limit_tokens_per_second, per minute", ["backend", "limit"]),
            ("bucket_level", "Deprecated (one release): qrq_bucket_requests and "
             "qrq_bucket_tokens", ["backend", "limit"]),
            ("recent_429s", "429s answered in the last minute", ["backend"]),
            ("paused_seconds", "Seconds left in a 429 pause", ["backend"]),
            ("breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open", ["backend"]),
        )}
        spend = {name: CounterMetricFamily(f"qrq_spend_{name}", doc, labels=labels)
                 for name, doc, labels in (
                     ("calls", "Backend calls made", ["backend"]),
                     ("tokens", "Tokens of backend calls", ["backend", "direction"]),
                     ("estimated_calls", "Calls whose reply gave no usage", ["backend"]),
                     ("cost", "Cost of backend calls (per the [price])", ["backend"]))}
        budget = {f"{unit}_{name}": GaugeMetricFamily(
            f"qrq_budget_{unit}_{name}", f"{doc} in {unit} (window: hour or total)",
            labels=["backend", "window"])
            for unit in ("tokens", "cost")
            for name, doc in (("limit", "A budget cap"), ("used", "A budget cap's use"))}
        budget |= {name: GaugeMetricFamily(  # deprecated, one release: a unit in a label
            f"qrq_budget_{name}", f"Deprecated (one release): qrq_budget_tokens_{name} and "
            f"qrq_budget_cost_{name}", labels=["backend", "cap"]) for name in ("limit", "used")}
        for row in backend_rows(app):
            name = row["backend"]
            total = row["spend"]["total"]
            spend["calls"].add_metric([name], total["calls"])
            spend["tokens"].add_metric([name, "in"], total["tokens_in"])
            spend["tokens"].add_metric([name, "out"], total["tokens_out"])
            spend["estimated_calls"].add_metric([name], total["estimated_calls"])
            spend["cost"].add_metric([name], total["cost"])
            for cap, figures in row["spend"]["budgets"].items():
                unit, window = BUDGET_CAPS[cap]
                for what in ("limit", "used"):
                    budget[f"{unit}_{what}"].add_metric([name, window], figures[what])
                    budget[what].add_metric([name, cap], figures[what])
            queue = app.backend_config(name).queue
            for level, depth in queue_depths(app.store, queue).items():
                g["queue_depth"].add_metric([name, Priority.name_of(level)], depth)
            g["breaker_state"].add_metric([name], BREAKER_STATES[app.flow.breaker(name).state()])
            if "leases_in_use" not in row:
                continue  # no limits configured: nothing more to show
            g["leases_in_use"].add_metric([name], row["leases_in_use"])
            g["max_concurrent"].add_metric([name], row["max_concurrent"] or 0)
            g["adaptive_limit"].add_metric([name], row["adaptive_limit"] or 0)
            g["recent_429s"].add_metric([name], row["recent_429s"])
            g["paused_seconds"].add_metric([name], row["paused_for_s"])
            for limit, figures in row["limits"].items():
                unit = LIMIT_UNITS[limit]
                g[f"limit_{unit}_per_second"].add_metric([name], figures["per_minute"] / 60)
                g[f"bucket_{unit}"].add_metric([name], figures["level"])
                g["rate_limit_per_minute"].add_metric([name, limit], figures["per_minute"])
                g["bucket_level"].add_metric([name, limit], figures["level"])
        yield from g.values()
        yield from spend.values()
        yield from budget.values()
        alive = GaugeMetricFamily("qrq_workers_alive", "Worker nodes with a fresh heartbeat")
        alive.add_metric([], sum(1 for _ in app.store.scan_iter(keys.alive("*"), count=1000)))
        yield alive
        lookups = CounterMetricFamily("qrq_cache_lookups", "Score cache lookups", labels=["route"])
        hits = CounterMetricFamily("qrq_cache_hits", "Score cache hits", labels=["route"])
        for route in app.qrq_config.routes.values():
            if route.cache:
                stats = app.store.hgetall(keys.cache_stats(route.name))
                lookups.add_metric([route.name], int(stats.get(b"lookups", 0)))
                hits.add_metric([route.name], int(stats.get(b"hits", 0)))
        yield lookups
        yield hits
        yield from _audit_metrics(app)
        yield from _job_metrics(app)


def _job_metrics(app: QrqCelery) -> Iterator[Any]:
    """Each job's spend and samples queued, labelled by job: the jobs of `[jobs.<job>]`, then
    the rest by name, up to `[jobs] max_labels`; the jobs beyond are summed as `other`."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    rows = job_rows(app.store, app.qrq_config)
    named = app.qrq_config.jobs.each
    rows.sort(key=lambda r: (r["job"] not in named, r["job"]))
    room = app.qrq_config.jobs.max_labels
    merged: dict[str, list[float]] = {}
    for i, row in enumerate(rows):
        label = row["job"] if i < room else OTHER_JOB
        total = row["total"]
        figures = [total["calls"], total["tokens_in"], total["tokens_out"], total["cost"],
                   row["queued"]]
        merged[label] = [a + b for a, b in zip(merged.get(label, [0.0] * 5), figures,
                                               strict=True)]
    calls = CounterMetricFamily("qrq_job_calls", "Backend calls made for a job", labels=["job"])
    tokens = CounterMetricFamily("qrq_job_tokens", "Tokens of a job's calls",
                                 labels=["job", "direction"])
    cost = CounterMetricFamily("qrq_job_cost", "Cost of a job's calls", labels=["job"])
    queued = GaugeMetricFamily("qrq_job_samples_queued",
                               "A job's samples waiting in the backends' queues", labels=["job"])
    for job, (n, t_in, t_out, c, q) in merged.items():
        calls.add_metric([job], n)
        tokens.add_metric([job, "in"], t_in)
        tokens.add_metric([job, "out"], t_out)
        cost.add_metric([job], c)
        queued.add_metric([job], q)
    yield from (calls, tokens, cost, queued)


def _audit_metrics(app: QrqCelery) -> Iterator[Any]:
    """Each audited route's agreement with its audit route over the current UTC hour."""
    from prometheus_client.core import GaugeMetricFamily

    figures = {name: GaugeMetricFamily(f"qrq_audit_{name}", doc, labels=["route", "audit"])
               for name, doc in (
                   ("samples", "Samples re-judged by the audit lane this UTC hour"),
                   ("mean_abs_diff", "Mean |route score - audit score| this hour"),
                   ("flip_rate", "Share of audited samples whose pass/fail flipped this hour"),
                   ("bias", "Mean route score - audit score this hour (> 0: more lenient)"))}
    for route in app.qrq_config.routes.values():
        if route.audit:
            now = audit.hours(app.store, route.name, last=1)
            row = now[0] if now else audit.agreement({})
            for name, family in figures.items():
                if row[name] is not None:
                    family.add_metric([route.name, route.audit.route], row[name])
    yield from figures.values()


def serve_exporter(app: QrqCelery, port: int, host: str = LOCAL) -> None:
    """Serve the Redis state on `host:port`/metrics (returns; the server runs in a thread),
    behind QRQ_METRICS_TOKEN when it is set (metrics_http.py)."""
    require("prometheus_client", "Prometheus metrics")
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(RedisStateCollector(app))
    serve_metrics(registry, host, port)
