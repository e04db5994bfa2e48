"""What each gateway job spent, and its `[gateway.budget.<job>]`, in Redis beside the backends'.

The gateway reads each reply's `usage` as it hands the reply over and adds it, with its cost
at the serving backend's `[price]`, to the job's running total and the current UTC hour
(`keys.job_spend`), in one round trip per FLUSH_EVERY_S for all its requests. Before a request
is sent, the job's use as of the last flush is checked against its caps: a job at a cap is
refused (429 `insufficient_quota`) until the hour turns (per-hour caps) or for good (totals).
Several gateways share the totals through Redis; what they overshoot a cap by is what was in
flight when it was reached, plus one flush interval of requests.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import redis

from .. import keys
from ..flow.spend import HOUR_KEEP_S, Usage, hour_now
from ..flow.spend import _figures as figures
from ..settings import Config

FLUSH_EVERY_S = 0.1
FIELDS = ("calls", "tokens_in", "tokens_out", "estimated", "cost_micro")


def reply_usage(raw: str) -> Usage:
    """`usage` of a chat-completion reply (an estimate from its size when it gives none)."""
    try:
        usage = json.loads(raw).get("usage") or {}
        return Usage(int(usage["prompt_tokens"]), int(usage["completion_tokens"]))
    except (ValueError, KeyError, TypeError, AttributeError):
        return Usage(0, len(raw) // 4, estimated=True)


class JobLedger:
    """This gateway's view of the jobs' spend: what it added since the last flush, and each
    budgeted job's use as Redis said at that flush."""

    def __init__(self, store: redis.Redis | None, config: Config):
        self.store, self.config = store, config
        self._lock = threading.Lock()
        self._tally: dict[tuple[str, int], list[int]] = {}
        self.used: dict[str, dict[str, float]] = {}  # budgeted job -> cap name -> use

    def spent(self, job: str, backend: str | None, usage: Usage) -> None:
        known = self.config.backends.get(backend or "")
        cost = usage.cost_micro(known) if known else 0
        values = (1, usage.tokens_in, usage.tokens_out, int(usage.estimated), cost)
        with self._lock:
            tally = self._tally.setdefault((job, hour_now()), [0] * len(FIELDS))
            for k, value in enumerate(values):
                tally[k] += value

    def refusal(self, job: str) -> str | None:
        """Why `job` may not send more (the cap it reached), else None."""
        budget = self.config.gateway.budgets.get(job)
        used = self.used.get(job, {})
        for cap, limit in (budget.limits() if budget else {}).items():
            if used.get(cap, 0.0) >= limit:
                return (f"budget {cap} = {limit:g} of job {job!r} reached "
                        f"({used[cap]:g} used)")
        return None

    def flush(self) -> None:
        """Write what was added and read back the budgeted jobs' use (one round trip); kept
        for the next flush when Redis is away."""
        if self.store is None:
            return
        with self._lock:
            tally, self._tally = self._tally, {}
        budgeted = sorted(self.config.gateway.budgets)
        hour = hour_now()
        try:
            with self.store.pipeline(transaction=False) as pipe:
                for (job, at), values in tally.items():
                    pipe.sadd(keys.JOBS, job)
                    for key in (keys.job_spend(job), keys.job_spend(job, at)):
                        for field, value in zip(FIELDS, values, strict=True):
                            if value:
                                pipe.hincrby(key, field, value)
                    pipe.expire(keys.job_spend(job, at), HOUR_KEEP_S)
                for job in budgeted:
                    pipe.hgetall(keys.job_spend(job))
                    pipe.hgetall(keys.job_spend(job, hour))
                done = pipe.execute()  # always: the writes are in it, reads or not
                read = done[len(done) - 2 * len(budgeted):]
        except (redis.RedisError, OSError):
            with self._lock:
                for slot, values in tally.items():
                    mine = self._tally.setdefault(slot, [0] * len(FIELDS))
                    for k, value in enumerate(values):
                        mine[k] += value
            return
        for i, job in enumerate(budgeted):
            total, this_hour = figures(read[2 * i]), figures(read[2 * i + 1])
            self.used[job] = {
                "tokens_total": total["tokens_in"] + total["tokens_out"],
                "tokens_per_hour": this_hour["tokens_in"] + this_hour["tokens_out"],
                "cost_total": total["cost"], "cost_per_hour": this_hour["cost"],
            }


def job_rows(store: redis.Redis) -> list[dict[str, Any]]:
    """Each gateway job's spend in total and this hour, and its share of all jobs' tokens."""
    jobs = sorted(j.decode() for j in store.smembers(keys.JOBS))  # type: ignore[union-attr]
    with store.pipeline(transaction=False) as pipe:
        for job in jobs:
            pipe.hgetall(keys.job_spend(job))
            pipe.hgetall(keys.job_spend(job, hour_now()))
        read = pipe.execute()
    totals = [figures(read[2 * i]) for i in range(len(jobs))]
    tokens = [t["tokens_in"] + t["tokens_out"] for t in totals]
    return [{"job": job, "total": total, "this_hour": figures(read[2 * i + 1]),
             "share": round(tokens[i] / (sum(tokens) or 1), 4)}
            for i, (job, total) in enumerate(zip(jobs, totals, strict=True))]
