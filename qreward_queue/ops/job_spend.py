"""What each job spent, and its budget (`[jobs.<job>.budget]`, or `[gateway.budget.<job>]`).

Workers add each call's usage, with its cost at the backend's `[price]`, to the job named in
its task's message (flow/spend.py: `keys.job_spend`, the running total and the current UTC
hour), so a job's spend is the same whether it submits from a trainer or through the gateway.
Before a request is sent, the gateway checks the job's use as of its last read (every
FLUSH_EVERY_S) against its caps: a job at a cap is refused (429 `insufficient_quota`) until the
hour turns (per-hour caps) or for good (totals); `submit_batch` checks the same at submit
(`refusal`). What a job overshoots a cap by is what was in flight when it was reached, plus one
read interval of requests.
"""

from __future__ import annotations

from typing import Any

import redis

from .. import keys
from ..config.model import Config
from ..flow.spend import _figures as figures
from ..flow.spend import hour_now
from ..priority import LEVELS

FLUSH_EVERY_S = 0.1


def job_use(store: redis.Redis, jobs: list[str]) -> dict[str, dict[str, float]]:
    """Each of `jobs`' use of every budget cap (tokens and cost, total and this hour)."""
    with store.pipeline(transaction=False) as pipe:
        for job in jobs:
            pipe.hgetall(keys.job_spend(job))
            pipe.hgetall(keys.job_spend(job, hour_now()))
        read = pipe.execute()
    used = {}
    for i, job in enumerate(jobs):
        total, this_hour = figures(read[2 * i]), figures(read[2 * i + 1])
        used[job] = {
            "tokens_total": total["tokens_in"] + total["tokens_out"],
            "tokens_per_hour": this_hour["tokens_in"] + this_hour["tokens_out"],
            "cost_total": total["cost"], "cost_per_hour": this_hour["cost"],
        }
    return used


def refusal(config: Config, job: str, used: dict[str, float]) -> str | None:
    """Why `job`, having used `used`, may not send more (the cap it reached), else None."""
    budget = config.jobs.budget(job)
    for cap, limit in (budget.limits() if budget else {}).items():
        if used.get(cap, 0.0) >= limit:
            return f"budget {cap} = {limit:g} of job {job!r} reached ({used[cap]:g} used)"
    return None


class JobLedger:
    """The gateway's view of the budgeted jobs' use, as Redis said at its last read."""

    def __init__(self, store: redis.Redis | None, config: Config):
        self.store, self.config = store, config
        self.used: dict[str, dict[str, float]] = {}  # budgeted job -> cap name -> use

    def refusal(self, job: str) -> str | None:
        """Why `job` may not send more (the cap it reached), else None."""
        return refusal(self.config, job, self.used.get(job, {}))

    def flush(self) -> None:
        """Read the budgeted jobs' use (one round trip); kept as it was when Redis is away."""
        if self.store is None:
            return
        try:
            self.used = job_use(self.store, sorted(self.config.jobs.budgets()))
        except (redis.RedisError, OSError):
            return


def job_rows(store: redis.Redis, config: Config) -> list[dict[str, Any]]:
    """Each job's spend in total and this hour, its share of all jobs' calls, its weight, its
    samples waiting in the backends' queues (all priorities) and its budget's caps with their
    use."""
    jobs = sorted({*(j.decode() for j in store.smembers(keys.JOBS)),  # type: ignore[union-attr]
                   *config.jobs.each})
    queued = waiting(store, config, jobs)
    with store.pipeline(transaction=False) as pipe:
        for job in jobs:
            pipe.hgetall(keys.job_spend(job))
            pipe.hgetall(keys.job_spend(job, hour_now()))
        read = pipe.execute()
    totals = [figures(read[2 * i]) for i in range(len(jobs))]
    calls = sum(t["calls"] for t in totals) or 1
    used = job_use(store, [j for j in jobs if config.jobs.budget(j)])
    rows = []
    for i, (job, total) in enumerate(zip(jobs, totals, strict=True)):
        budget = config.jobs.budget(job)
        caps = budget.limits() if budget else {}
        rows.append({
            "job": job, "total": total, "this_hour": figures(read[2 * i + 1]),
            "share": round(total["calls"] / calls, 4), "weight": config.jobs.weight(job),
            "queued": queued.get(job, 0),
            "budgets": {cap: {"limit": limit, "used": round(used[job][cap], 6),
                              "left": round(max(0.0, limit - used[job][cap]), 6)}
                        for cap, limit in caps.items()}})
    return rows


def waiting(store: redis.Redis, config: Config, jobs: list[str]) -> dict[str, int]:
    """Each of `jobs`' samples waiting in the backends' queues (published, not yet started),
    as fair shares count them (trainer/shares.py)."""
    hashes = [keys.share_keys(b.queue, level)["queued"]
              for b in config.backends.values() for level in sorted(set(LEVELS.values()))]
    if not jobs or not hashes:
        return {}
    with store.pipeline(transaction=False) as pipe:
        for key in hashes:
            pipe.hmget(key, jobs)
        read = pipe.execute()
    return {job: sum(max(0, int(row[k] or 0)) for row in read) for k, job in enumerate(jobs)}
