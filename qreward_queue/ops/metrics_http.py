"""The /metrics endpoint of `qrq exporter` and `qrq worker --metrics-port`, optionally behind
a bearer token: with QRQ_METRICS_TOKEN set, a scrape without `Authorization: Bearer <token>`
gets a 401 (Prometheus: `authorization: {credentials_file: ...}` in its scrape config)."""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from .. import background

TOKEN_ENV = "QRQ_METRICS_TOKEN"
LOCAL = "127.0.0.1"

_App = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach `host` (127.0.0.1, ::1, localhost)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve_metrics(registry: Any, host: str, port: int) -> None:
    """Serve `registry` on host:port/metrics from a daemon thread (returns at once)."""
    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    app: _App = make_wsgi_app(registry)
    token = os.environ.get(TOKEN_ENV) or None
    if token:
        app = _bearer(app, token)
    server = make_server(host, port, app, ThreadingWSGIServer, handler_class=_Quiet)
    background.thread("qrq-metrics", server.serve_forever)


def _bearer(app: _App, token: str) -> _App:
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        given = environ.get("HTTP_AUTHORIZATION", "").encode()
        if not hmac.compare_digest(given, expected):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"),
                                                ("WWW-Authenticate", "Bearer")])
            return [b"a bearer token is required (QRQ_METRICS_TOKEN)\n"]
        return app(environ, start_response)

    return guarded


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # no line per scrape
        pass
