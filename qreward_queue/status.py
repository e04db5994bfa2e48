"""`qrq status`: what each backend's queue and limiter look like right now."""

from __future__ import annotations

from .app import QrqCelery
from .capacity import queue_depth
from .config import Config
from .liveness import live_workers


def backend_rows(app: QrqCelery) -> list[dict]:
    """One row per backend: queue depth plus the limiter's view (levels, leases, AIMD, 429s)."""
    rows = []
    for name, backend in app.qrq_config.backends.items():
        limiter = app.limiter(name)
        row = {
            "backend": name,
            "kind": backend.kind,
            "queued": queue_depth(app.store, backend.queue),
            "workers": len(live_workers(app.store, backend.queue)),
        }
        row.update(limiter.status() if limiter else {})
        rows.append(row)
    return rows


def render_status(config: Config) -> str:
    if config.embedded:
        return "embedded mode keeps no shared state between processes; set QRQ_REDIS_URL"
    lines = [
        f"{'backend':<16}{'kind':<14}{'queued':>7}{'workers':>8}  {'rpm level/cap':>15}  "
        f"{'tpm level/cap':>17}  {'leases':>8}  {'adaptive':>8}  {'429s/60s':>8}  paused"
    ]
    for row in backend_rows(QrqCelery(config)):

        def level(kind: str, row: dict = row) -> str:
            lim = row.get("limits", {}).get(kind)
            return f"{lim['level']:.1f}/{lim['capacity']:g}" if lim else "-"

        leases = f"{row.get('leases_in_use', 0)}/{row.get('max_concurrent') or '-'}"
        lines.append(
            f"{row['backend']:<16}{row['kind']:<14}{row['queued']:>7}{row['workers']:>8}  "
            f"{level('rpm'):>15}  "
            f"{level('tpm'):>17}  {leases:>8}  {row.get('adaptive_limit') or '-':>8}  "
            f"{row.get('recent_429s', 0):>8}  {row.get('paused_for_s', 0.0):.1f}s"
        )
    return "\n".join(lines)
