"""Every Redis key qrq reads or writes, named in one place.

Everything lives under the `qrq:` prefix, which kombu and the result store also apply
(`global_keyprefix`), so one `SCAN qrq:*` shows all of qrq's state. Keys of one backend's
limiter and breaker share the hash tag `{<backend>}` (one Redis Cluster slot, so a Lua
script may touch them together).
"""

from __future__ import annotations

PREFIX = "qrq:"
PRIORITY_LEVELS = 10  # kombu keeps one list per priority level (0 = the bare queue name)


def queue_lists(queue: str) -> list[str]:
    """kombu's lists for `queue`, one per priority level (sep ':', `qrq:` prefix)."""
    return [f"{PREFIX}{queue}"] + [f"{PREFIX}{queue}:{p}" for p in range(1, PRIORITY_LEVELS)]


def queued_samples(queue: str) -> str:
    """Counter of the samples waiting in `queue`: + at publish, - when a worker takes them."""
    return f"{PREFIX}queued:{queue}"


def share_keys(queue: str, level: int) -> dict[str, str]:
    """Fair shares of one queue's priority level (trainer/shares.py, flow/lua/share.lua): the
    jobs active on it (zset: job -> last seen, ms), the samples each has waiting in it (hash:
    job -> count: + as its client publishes, - as a worker starts a task), their weights
    (hash: job -> weight) and the channel a worker announces a start on. One hash tag, so
    that one script may touch them together."""
    tag = f"{PREFIX}{{share:{queue}:{level}}}"
    return {"active": f"{tag}:active", "queued": f"{tag}:queued", "weights": f"{tag}:weights",
            "drained": f"{tag}:drained"}


# the pub/sub channels of every level: a worker that starts a task publishes the job on its
# level's `drained` channel, and each process's fair-share gate waits for that to check again
SHARES_DRAINED = f"{PREFIX}{{share:*}}:drained"


# A worker's heartbeat: `alive` every HEARTBEAT_S with a TTL of HEARTBEAT_TTL_S (a client
# resubmits the tasks `held` by a node whose `alive` lapsed); a running task's `held` key is
# refreshed as often and lapses after HELD_TTL_S; `consumers` outlives any pause in heartbeats.
HEARTBEAT_S = 5
HEARTBEAT_TTL_S = 15
HELD_TTL_S = 6 * 3600
CONSUMERS_TTL_S = 24 * 3600


def held(task_id: str) -> str:
    """The node holding a task (running it, or waiting out its retry countdown)."""
    return f"{PREFIX}held:{task_id}"


def alive(node: str) -> str:
    """Exists while a worker node's heartbeat is fresh."""
    return f"{PREFIX}alive:{node}"


def call_pools(node: str) -> str:
    """A worker node's calls in flight per backend and why (JSON), refreshed by its heartbeat."""
    return f"{PREFIX}calls:{node}"


def consumers(queue: str) -> str:
    """Set of the worker nodes whose heartbeat says they consume `queue`."""
    return f"{PREFIX}consumers:{queue}"


def batch_sentinel(batch_id: str) -> str:
    """Set at submit; gone means Redis lost its data (a restart without persistence)."""
    return f"{PREFIX}batch:{batch_id}"


# A batch's lease: its client sets the key with a TTL of lease_ttl_ms(lease_s) and workers
# wait LEASE_CONFIRM_S more (a lease a Redis outage let expire is set again at once), so they
# stop within the configured lease_s of the last renewal.
LEASE_CONFIRM_S = 2.0  # a worker counts a lapsed lease once it has seen it lapsed this long


def lease(batch_id: str) -> str:
    """A batch's lease: `live` while its client renews it (short TTL), then `cancelled` or
    `done`; workers make no call for a batch whose lease says so or lapsed."""
    return f"{PREFIX}lease:{batch_id}"


def lease_ttl_ms(lease_s: float) -> int:
    """The TTL of a live lease's key: the configured lease less the workers' confirmation
    (LEASE_CONFIRM_S), at least a second."""
    return int(max(1.0, lease_s - LEASE_CONFIRM_S) * 1000)


def records(batch_id: str) -> str:
    """Hash of a batch's finished samples (input index -> outcome JSON), written by workers as
    each finishes, so that a chunk run again calls only what is still missing."""
    return f"{PREFIX}done:{batch_id}"


def inbox(batch_id: str) -> str:
    """Stream of what finished for the client process that submitted `batch_id` (its batch
    ids are `<client>.<batch>`): one entry per records flush and per chunk task that ended,
    across all its batches, which its one reader blocks on (records.read_inbox)."""
    return f"{PREFIX}inbox:{batch_id.split('.', 1)[0]}"


DEAD_LETTERS = f"{PREFIX}dead-letters"  # malformed task messages, newest first, kept to inspect


def _tag(backend: str) -> str:
    return f"{PREFIX}{{{backend}}}"


def limiter(backend: str) -> dict[str, str]:
    """The limiter's keys: bucket hash, leases zset, AIMD hash, recent-429 counter, and the
    list of released leases that callers waiting for one block on (one entry per release)."""
    tag = _tag(backend)
    return {
        "bucket": f"{tag}:bucket",
        "leases": f"{tag}:leases",
        "aimd": f"{tag}:aimd",
        "recent429": f"{tag}:recent429",
        "released": f"{tag}:released",
    }


def breaker(backend: str) -> dict[str, str]:
    """The circuit breaker's keys: failure count, open flag, tripped flag, half-open probe."""
    tag = _tag(backend)
    return {name: f"{tag}:{name}" for name in ("fails", "open", "tripped", "probe")}


def spend(backend: str, hour: int | None = None) -> str:
    """A backend's spend hash: the running total or, with `hour` (UTC hours since the epoch),
    that hour's (kept 2 h). Fields: calls, tokens_in, tokens_out, estimated (calls whose reply
    gave no usage: their estimate is counted), cost_micro (millionths of the price's unit);
    an hour's also held_tokens, held_cost_micro (booked by calls in flight under a budget)."""
    return f"{_tag(backend)}:spend" + ("" if hour is None else f":{hour}")


def job_spend(job: str, hour: int | None = None) -> str:
    """A gateway job's spend hash (as `spend`: the running total, or one UTC hour's)."""
    return f"{PREFIX}job:{job}:spend" + ("" if hour is None else f":{hour}")


JOBS = f"{PREFIX}jobs"  # set of the gateway jobs that have spent something


def gateway_reply(identity: str, request: str) -> str:
    """A gateway's cached chat reply: the route's identity and the request body's digest."""
    return f"{PREFIX}gwcache:{identity}:{request}"


def batch_spend(batch_id: str) -> str:
    """One batch's spend per backend (fields `<backend>:<field>`), for its summary()."""
    return f"{PREFIX}spend:{batch_id}"


def cache_stats(route: str) -> str:
    """Hash counting one route's cache lookups and hits (for the Prometheus exporter)."""
    return f"{PREFIX}stats:cache:{route}"


def audit(route: str, hour: int | None = None) -> str:
    """A route's audit lane (ops/audit.py): with `hour` (UTC hours since the epoch) that
    hour's agreement hash; without, the list of its latest disagreeing samples (JSON)."""
    return f"{PREFIX}audit:{route}:" + ("disagree" if hour is None else str(hour))


def cache(identity: str) -> str:
    """Prefix of the score cache of one reward identity (content key appended)."""
    return f"{PREFIX}cache:{identity}:"
