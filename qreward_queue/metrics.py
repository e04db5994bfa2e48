"""Prometheus metrics: what the workers did (counters) and what Redis holds (read per scrape).

Why two halves: counters of calls, samples and waits live where the work happens, in each
worker process (Prometheus' multi-process mode, so a prefork pool's children add up), while
queue depth, leases, the adaptive limit and the breaker are shared state that one exporter
reads from Redis for every scrape (`qrq exporter`), so they are never double counted.

Off by default and free when off: every `record_*` call is one global lookup until
`enable()` runs (`qrq worker --metrics-port`). Needs the `metrics` extra (prometheus_client).

Worker metrics (labels):
    qrq_samples_total{backend,route,status}        samples settled by a worker, by outcome status
    qrq_backend_requests_total{backend,code}       calls to the backend by HTTP status
                                                   (or ok / timeout / error without one)
    qrq_backend_latency_seconds{backend}           one call's duration (histogram)
    qrq_limiter_wait_seconds{backend}              time a call waited for the global limiter
    qrq_retries_total{backend,reason}              task retries: backoff, limiter_busy, failover
    qrq_failovers_total{backend,to}                work moved to a sibling backend
Exporter metrics (read from Redis at scrape time):
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
"""

from __future__ import annotations

import atexit
import collections
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from celery.signals import task_success

from . import keys
from .errors import ConfigError
from .extras import require

if TYPE_CHECKING:
    import redis

    from .app import QrqCelery
    from .config import Config

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
PRIORITY_NAMES = {0: "val", 6: "train", 9: "bulk"}  # app.PRIORITIES, by level
BREAKER_STATES = {"closed": 0, "half-open": 1, "open": 2}


class _WorkerMetrics:
    """The worker-side metric objects, created once `enable()` has run."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter, Histogram

        reg = {"registry": registry or REGISTRY}
        self.samples = Counter(
            "qrq_samples", "Samples settled by a worker, by outcome status",
            ["backend", "route", "status"], **reg)
        self.requests = Counter(
            "qrq_backend_requests", "Calls to a backend by HTTP status (ok/timeout/error if none)",
            ["backend", "code"], **reg)
        self.latency = Histogram(
            "qrq_backend_latency_seconds", "Duration of one backend call", ["backend"],
            buckets=LATENCY_BUCKETS, **reg)
        self.limiter_wait = Histogram(
            "qrq_limiter_wait_seconds", "Time a call waited for the global limiter", ["backend"],
            buckets=WAIT_BUCKETS, **reg)
        self.retries = Counter(
            "qrq_retries", "Task retries by reason (backoff, limiter_busy, failover)",
            ["backend", "reason"], **reg)
        self.failovers = Counter(
            "qrq_failovers", "Work moved from a backend to a sibling", ["backend", "to"], **reg)


_metrics: _WorkerMetrics | None = None


def enable() -> None:
    """Create the worker metrics (idempotent). Set PROMETHEUS_MULTIPROC_DIR before, for prefork."""
    global _metrics
    if _metrics is None:
        _metrics = _WorkerMetrics()


def record_outcomes(route: str | None, outcomes: Iterable[dict | None]) -> None:
    """Count settled outcome dicts by the backend that produced each and its status."""
    if _metrics is None:
        return
    counts = collections.Counter(
        (o.get("backend") or "-", o["status"]) for o in outcomes if o is not None)
    for (backend, status), n in counts.items():  # one file write per label set, not per sample
        _metrics.samples.labels(backend, route or "-", status).inc(n)


@task_success.connect
def _count_outcomes(sender=None, result=None, **_) -> None:
    """A finished score_chunk's outcomes, counted in the process that ran it (pool child)."""
    if _metrics is None:
        return
    from .message import TASK_NAME

    if sender is not None and sender.name == TASK_NAME and isinstance(result, list):
        config = sender.app.qrq_config
        record_outcomes(route_name(config, sender.request.kwargs.get("route")), result)


def record_request(backend: str, status_code: int | None, latency_s: float,
                   failure: str | None = None) -> None:
    """One backend call and its duration, labelled by HTTP status; without one by `failure`
    ("timeout", "error"), or `ok` (a function backend answered)."""
    if _metrics is None:
        return
    _metrics.requests.labels(backend, str(status_code) if status_code else failure or "ok").inc()
    _metrics.latency.labels(backend).observe(latency_s)


def record_limiter_wait(backend: str, seconds: float) -> None:
    if _metrics is not None:
        _metrics.limiter_wait.labels(backend).observe(seconds)


def record_retry(backend: str, reason: str, to: str | None = None) -> None:
    """A task retry; `to` names the sibling a failover moves the work to."""
    if _metrics is None:
        return
    _metrics.retries.labels(backend, reason).inc()
    if to is not None:
        _metrics.failovers.labels(backend, to).inc()


def route_name(config: Config, backends: Sequence[str] | None) -> str | None:
    """The route a task's backend list belongs to (tasks carry the list, not the name)."""
    wanted = tuple(backends or ())
    return next((r.name for r in config.routes.values() if r.backends == wanted), None)


def record_cache(store: redis.Redis, route: str, lookups: int, hits: int) -> None:
    """Count a batch's cache lookups and hits in Redis, where the exporter reads them."""
    if lookups:
        with store.pipeline(transaction=False) as pipe:
            pipe.hincrby(keys.cache_stats(route), "lookups", lookups)
            pipe.hincrby(keys.cache_stats(route), "hits", hits)
            pipe.execute()


def measured_latency_s(urls: Iterable[str]) -> dict[str, float]:
    """Mean backend call latency per backend, from the workers' /metrics pages at `urls`."""
    _require_client()
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, list[float]] = {}
    for url in urls:
        try:
            text = requests.get(url, timeout=10).text
        except requests.RequestException as exc:
            raise ConfigError(f"{url}: cannot read metrics ({exc})") from None
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in ("qrq_backend_latency_seconds_sum",
                              "qrq_backend_latency_seconds_count"):
                    pair = sums.setdefault(s.labels["backend"], [0.0, 0.0])
                    pair[s.name.endswith("_count")] += s.value
    return {backend: total / count for backend, (total, count) in sums.items() if count}


# -- serving --------------------------------------------------------------------------------


def serve_worker(port: int, host: str = "0.0.0.0") -> str:
    """Expose this worker's metrics (all its pool processes) on `host:port`/metrics.

    Must run before the pool starts and before anything imports prometheus_client: it sets
    PROMETHEUS_MULTIPROC_DIR (a fresh directory unless already set) so that every pool
    process writes its counters to files that the one HTTP server here adds up.
    """
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        path = tempfile.mkdtemp(prefix="qrq-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    _require_client()  # only now: prometheus_client picks its value store at import
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=path)
    start_http_server(port, addr=host, registry=registry)
    enable()
    return path


def _require_client() -> None:
    """A clear one-line error instead of an ImportError when the extra is missing."""
    require("prometheus_client", "Prometheus metrics")


class RedisStateCollector:
    """A prometheus_client collector that reads qrq's shared state from Redis per scrape."""

    def __init__(self, app: QrqCelery):
        self.app = app

    def describe(self) -> list:
        return []  # not known before a scrape; keeps registration from calling collect()

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from .status import backend_rows, queue_depths

        app = self.app
        g = {name: GaugeMetricFamily(f"qrq_{name}", doc, labels=labels) for name, doc, labels in (
            ("queue_depth", "Messages waiting in a backend's queue", ["backend", "priority"]),
            ("leases_in_use", "Concurrency leases held now", ["backend"]),
            ("max_concurrent", "Configured concurrency limit", ["backend"]),
            ("adaptive_limit", "Concurrency limit the AIMD controller allows now", ["backend"]),
            ("rate_limit_per_minute", "Rate the limiter enforces now", ["backend", "limit"]),
            ("bucket_level", "Units left in the bucket (negative: booked ahead)",
             ["backend", "limit"]),
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
        budget = {name: GaugeMetricFamily(f"qrq_budget_{name}", doc, labels=["backend", "cap"])
                  for name, doc in (("limit", "A budget cap"), ("used", "A budget cap's use"))}
        for row in backend_rows(app):
            name = row["backend"]
            total = row["spend"]["total"]
            spend["calls"].add_metric([name], total["calls"])
            spend["tokens"].add_metric([name, "in"], total["tokens_in"])
            spend["tokens"].add_metric([name, "out"], total["tokens_out"])
            spend["estimated_calls"].add_metric([name], total["estimated_calls"])
            spend["cost"].add_metric([name], total["cost"])
            for cap, figures in row["spend"]["budgets"].items():
                budget["limit"].add_metric([name, cap], figures["limit"])
                budget["used"].add_metric([name, cap], figures["used"])
            queue = app.backend_config(name).queue
            for level, depth in queue_depths(app.store, queue).items():
                g["queue_depth"].add_metric([name, PRIORITY_NAMES.get(level, str(level))], depth)
            g["breaker_state"].add_metric([name], BREAKER_STATES[breaker_state(app, name)])
            if "leases_in_use" not in row:
                continue  # no limits configured: nothing more to show
            g["leases_in_use"].add_metric([name], row["leases_in_use"])
            g["max_concurrent"].add_metric([name], row["max_concurrent"] or 0)
            g["adaptive_limit"].add_metric([name], row["adaptive_limit"] or 0)
            g["recent_429s"].add_metric([name], row["recent_429s"])
            g["paused_seconds"].add_metric([name], row["paused_for_s"])
            for limit, figures in row["limits"].items():
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


def breaker_state(app: QrqCelery, backend: str) -> str:
    """closed, half-open (tripped, cooldown over, waiting for a probe's success) or open."""
    breaker = app.breaker(backend)
    is_open, tripped = app.store.mget(breaker.open_key, breaker.tripped)
    return "open" if is_open else "half-open" if tripped else "closed"


def serve_exporter(app: QrqCelery, port: int, host: str = "0.0.0.0") -> None:
    """Serve the Redis state on `host:port`/metrics (returns; the server runs in a thread)."""
    _require_client()
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(RedisStateCollector(app))
    start_http_server(port, addr=host, registry=registry)
