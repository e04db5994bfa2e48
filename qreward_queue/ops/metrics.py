"""Prometheus counters of what a worker did: calls, samples, waits, retries.

They live where the work happens, in each worker process (Prometheus' multi-process mode, so a
prefork pool's children add up). Shared state (queues, leases, limits, the breaker, spend) is
read from Redis per scrape by the exporter (`exporter.py`), so it is never double counted.

Off by default and free when off: every `record_*` call is one global lookup until
`enable()` runs (`qrq worker --metrics-port`). Needs the `metrics` extra (prometheus_client).

Worker metrics (labels):
    qrq_samples_total{backend,route,status}        samples settled by a worker, by outcome status
    qrq_backend_requests_total{backend,code}       calls to the backend by HTTP status
                                                   (or ok / timeout / error without one)
    qrq_backend_latency_seconds{backend}           one call's duration (histogram)
    qrq_limiter_wait_seconds{backend}              time a call waited for the global limiter
    qrq_retries_total{backend,reason}              retries: fault, hedge, backoff, failover, ...
    qrq_failovers_total{backend,to}                work moved to a sibling backend
    qrq_injection_flagged_total{backend,route}     samples whose response addressed the judge
"""

from __future__ import annotations

import atexit
import collections
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from celery.signals import task_success

from ..config.extras import require
from ..errors import ConfigError
from ..message import TASK_NAME
from ..samples import flagged
from .metrics_http import LOCAL, serve_metrics

if TYPE_CHECKING:
    from ..config.model import Config

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _WorkerMetrics:
    """The worker-side metric objects, created once `enable()` has run."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter, Histogram

        reg: dict[str, Any] = {"registry": registry or REGISTRY}
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
            "qrq_retries",
            "Retries by reason (fault, hedge, backoff, limiter_busy, failover, straggler)",
            ["backend", "reason"], **reg)
        self.failovers = Counter(
            "qrq_failovers", "Work moved from a backend to a sibling", ["backend", "to"], **reg)
        self.injection = Counter(
            "qrq_injection_flagged", "Samples whose response addressed the judge (injection)",
            ["backend", "route"], **reg)


_metrics: _WorkerMetrics | None = None


def enable() -> None:
    """Create the worker metrics (idempotent). Set PROMETHEUS_MULTIPROC_DIR before, for
    prefork."""
    global _metrics
    if _metrics is None:
        _metrics = _WorkerMetrics()


def record_outcomes(route: str | None, outcomes: Iterable[dict | None]) -> None:
    """Count settled outcome dicts by the backend that produced each and its status."""
    if _metrics is None:
        return
    outcomes = list(outcomes)
    counts = collections.Counter(
        (o.get("backend") or "-", o["status"]) for o in outcomes if o is not None)
    for (backend, status), n in counts.items():  # one file write per label set, not per sample
        _metrics.samples.labels(backend, route or "-", status).inc(n)
    addressed = collections.Counter(o.get("backend") or "-" for o in outcomes
                                    if o is not None and flagged(o.get("detail")))
    for backend, n in addressed.items():
        _metrics.injection.labels(backend, route or "-").inc(n)


@task_success.connect
def _count_outcomes(sender=None, result=None, **_) -> None:
    """A finished chunk's outcomes, counted in the process that ran it (pool child)."""
    if _metrics is None:
        return
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
    """A retry (of a call in its run, or of a task); `to` names the sibling a failover
    moves the work to."""
    if _metrics is None:
        return
    _metrics.retries.labels(backend, reason).inc()
    if to is not None:
        _metrics.failovers.labels(backend, to).inc()


def route_name(config: Config, backends: Sequence[str] | None) -> str | None:
    """The route a task's backend list belongs to (tasks carry the list, not the name)."""
    wanted = tuple(backends or ())
    return next((r.name for r in config.routes.values() if r.backends == wanted), None)


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


def serve_worker(port: int, host: str = LOCAL) -> str:
    """Expose this worker's metrics (all its pool processes) on `host:port`/metrics (behind
    QRQ_METRICS_TOKEN when it is set: metrics_http.py).

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
    from prometheus_client import CollectorRegistry, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=path)
    serve_metrics(registry, host, port)
    enable()
    return path


def _require_client() -> None:
    """A clear one-line error instead of an ImportError when the extra is missing."""
    require("prometheus_client", "Prometheus metrics")
