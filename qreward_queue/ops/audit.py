"""The audit lane: how often a route's judge disagrees with a stronger one, while training runs.

A route with `audit = { route = "strong", fraction = 0.02 }` has a seeded share of its `ok`
outcomes judged again on the audit route at `bulk` priority, after its batch has returned
(trainer/integrity.py starts it; the trainer never waits for it). Each pair (the route's
score, the audit's) is counted in Redis per route and UTC hour; samples the two disagree on
are kept in a short list for a look (`qrq audit --route R`). `qrq status`, the exporter and
the Grafana dashboard read the hours back.

Agreement of an hour: `mean_abs_diff` (mean |route - audit|), `flip_rate` (share where one
passes, score >= threshold, and the other does not), `bias` (mean route - audit: above 0 the
route's judge is the more lenient). A pair disagrees when it flips or differs by more than
DISAGREE_ABOVE.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from typing import Any

import redis

from .. import keys
from ..config.model import Audit

HOUR_S = 3600
KEEP_HOURS = 24 * 8  # an hour's counts live a week and a day
KEEP_DISAGREEMENTS = 1000  # the latest disagreeing samples kept per route
DISAGREE_ABOVE = 0.25
QUOTE_CHARS = 2000  # of a kept sample's prompt and response


def chosen(audit: Audit, sample: dict[str, Any]) -> bool:
    """Whether the lane re-judges `sample`: a draw from its content and the seed, so the same
    samples are audited in every run and by every trainer process."""
    text = json.dumps([audit.seed, sample.get("prompt"), sample.get("response")])
    draw = int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:8], "big")
    return draw < audit.fraction * 2**64


def record(store: redis.Redis, route: str, audit: Audit,
           pairs: Sequence[tuple[dict[str, Any], float, float | None]]) -> int:
    """Count (sample, route score, audit score or None: the audit failed) pairs in the hour's
    hash, keep the disagreeing samples; returns how many disagreed."""
    hour = int(time.time() // HOUR_S)
    counts = {"samples": 0, "failed": 0, "flips": 0, "abs_diff_micro": 0, "diff_micro": 0}
    kept = []
    for sample, score, audited in pairs:
        if audited is None:
            counts["failed"] += 1
            continue
        flip = (score >= audit.threshold) != (audited >= audit.threshold)
        counts["samples"] += 1
        counts["flips"] += flip
        counts["abs_diff_micro"] += round(abs(score - audited) * 1e6)
        counts["diff_micro"] += round((score - audited) * 1e6)
        if flip or abs(score - audited) > DISAGREE_ABOVE:
            kept.append(json.dumps({
                "at": round(time.time(), 3), "score": score, "audit_score": audited,
                "audit_route": audit.route, "prompt": str(sample.get("prompt"))[:QUOTE_CHARS],
                "response": str(sample.get("response"))[:QUOTE_CHARS], "id": sample.get("id"),
            }))
    with store.pipeline(transaction=False) as pipe:
        for field, n in counts.items():
            pipe.hincrby(keys.audit(route, hour), field, n)
        pipe.expire(keys.audit(route, hour), KEEP_HOURS * HOUR_S)
        if kept:
            pipe.lpush(keys.audit(route), *kept)
            pipe.ltrim(keys.audit(route), 0, KEEP_DISAGREEMENTS - 1)
        pipe.execute()
    return len(kept)


def hours(store: redis.Redis, route: str, last: int = 24) -> list[dict[str, Any]]:
    """The agreement of each of the `last` UTC hours that saw audits, oldest first."""
    now = int(time.time() // HOUR_S)
    wanted = list(range(now - last + 1, now + 1))
    with store.pipeline(transaction=False) as pipe:
        for hour in wanted:
            pipe.hgetall(keys.audit(route, hour))
        raw = pipe.execute()
    return [agreement({k.decode(): int(v) for k, v in r.items()}, hour)
            for hour, r in zip(wanted, raw, strict=True) if r]


def agreement(counts: dict[str, int], hour: int | None = None) -> dict[str, Any]:
    """An hour's counts as the figures status, exporter and dashboard show."""
    n = counts.get("samples", 0)
    when = None if hour is None else time.strftime("%Y-%m-%d %H:00", time.gmtime(hour * HOUR_S))
    return {
        "hour": when,
        "samples": n, "failed": counts.get("failed", 0),
        "mean_abs_diff": counts.get("abs_diff_micro", 0) / 1e6 / n if n else None,
        "flip_rate": counts.get("flips", 0) / n if n else None,
        "bias": counts.get("diff_micro", 0) / 1e6 / n if n else None,
    }


def total(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The agreement over several hours' rows (weighted by their samples)."""
    n = sum(r["samples"] for r in rows)
    counts = {"samples": n, "failed": sum(r["failed"] for r in rows)}
    for field, figure in (("abs_diff_micro", "mean_abs_diff"), ("flips", "flip_rate"),
                          ("diff_micro", "bias")):
        scale = 1 if field == "flips" else 1e6
        counts[field] = round(sum((r[figure] or 0) * r["samples"] for r in rows) * scale)
    return agreement(counts)


def disagreements(store: redis.Redis, route: str, limit: int = 20) -> list[dict[str, Any]]:
    """The latest disagreeing samples of `route`'s audit lane, newest first."""
    return [json.loads(item) for item in store.lrange(keys.audit(route), 0, limit - 1)]


def render(route: str, rows: Sequence[dict[str, Any]]) -> list[str]:
    """`qrq status` lines of one audited route: the last hours, then their total."""
    def figures(r: dict[str, Any]) -> str:
        if not r["samples"]:
            return f"0 audited, {r['failed']} failed"
        return (f"{r['samples']:,} audited, mean |diff| {r['mean_abs_diff']:.3f}, "
                f"flips {r['flip_rate']:.1%}, bias {r['bias']:+.3f}"
                + (f", {r['failed']} failed" if r["failed"] else ""))

    lines = [f"  {route}: audit {r['hour']} UTC: {figures(r)}" for r in rows[-3:]]
    return [*lines, f"  {route}: audit last {len(rows)} h: {figures(total(rows))}"] if rows else []
