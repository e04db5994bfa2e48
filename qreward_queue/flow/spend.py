"""Spend: the tokens (and, with a `[price]`, the cost) of every backend call, summed per backend
in Redis for `summary()`, `qrq status` and the exporter, and capped by an optional `[budget]`.

After each call its usage (the reply's `usage`, or its upper bound when it gave none, counted
in `estimated`) is added to the backend's running total, the current UTC hour and the batch's
own tally (`keys.spend`, `keys.batch_spend`); a process writes what it added every
FLUSH_EVERY_S in one round trip. With a budget, each call first books an upper bound of its
cost (`Ledger.bound`) in one atomic Lua step that refuses it (BudgetExceeded) when the booking
would pass a cap: the call is never made. The booking is held in the hour's hash until the
call's real usage replaces it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import redis

from .. import flushing, keys
from ..errors import BudgetExceeded
from ..message import DEFAULT_JOB

if TYPE_CHECKING:  # flow sits below the configuration: it is handed its backend
    from ..config.model import Backend, Budget

FIELDS = ("calls", "tokens_in", "tokens_out", "estimated", "cost_micro")
FLUSH_EVERY_S = 0.1
HOUR_KEEP_S = 2 * 3600
BATCH_KEEP_S = 6 * 3600
CAPS = ("tokens_per_hour", "tokens_total", "cost_per_hour", "cost_total")
BOUND_MARGIN = 1.25  # over the most tokens per byte seen: a call's bound stays an upper bound

# KEYS: total, hour. ARGV: tokens, cost_micro, the four caps of CAPS ('' = none; cost ones in
# micro units), the hour's TTL. Returns {} (booked) or {cap, used} (refused).
_BOOK = """
local function n(key, f) return tonumber(redis.call('HGET', key, f) or '0') end
local held_t, held_c = n(KEYS[2], 'held_tokens'), n(KEYS[2], 'held_cost_micro')
local used = {
  n(KEYS[2], 'tokens_in') + n(KEYS[2], 'tokens_out') + held_t,
  n(KEYS[1], 'tokens_in') + n(KEYS[1], 'tokens_out') + held_t,
  n(KEYS[2], 'cost_micro') + held_c,
  n(KEYS[1], 'cost_micro') + held_c,
}
for i = 1, 4 do
  local cap = ARGV[2 + i]
  if cap ~= '' then
    local want = tonumber(ARGV[i <= 2 and 1 or 2])
    if used[i] + want > tonumber(cap) then return {i, tostring(used[i])} end
  end
end
redis.call('HINCRBY', KEYS[2], 'held_tokens', ARGV[1])
redis.call('HINCRBY', KEYS[2], 'held_cost_micro', ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[7])
return {}
"""


def hour_now() -> int:
    return int(time.time() // 3600)


@dataclass(frozen=True)
class Usage:
    """Tokens one call cost; `estimated` when the reply did not say."""

    tokens_in: int
    tokens_out: int
    estimated: bool = False

    def cost_micro(self, backend: Backend) -> int:
        price = backend.price
        if price is None:
            return 0
        return round(self.tokens_in * price.input_per_million
                     + self.tokens_out * price.output_per_million)

    @classmethod
    def estimate(cls, tokens_in: float, tokens_out: float) -> Usage:
        return cls(math.ceil(tokens_in), math.ceil(tokens_out), estimated=True)


@dataclass(frozen=True)
class Booking:
    """What a call booked against its backend's budget, in which hour's hash."""

    hour: int
    tokens: int
    cost_micro: int


_K = TypeVar("_K")


class Ledger:
    """One backend's spend as this process's calls add to it (thread-safe).

    A call under a budget books an upper bound of what it can cost (`bound`): its input bytes
    times the tokens per byte this backend's replies have shown (at most one token a byte
    until a reply with `usage` says, then the most seen with a margin), plus every output
    token it may write. So a cap is passed by no more than the calls in flight when it is
    reached could still add beyond their bound, whatever the script of the text or whether
    replies carry `usage` (a reply without it is counted at one token a byte, marked
    estimated: whatever order replies come in, the same call counts the same).
    """

    def __init__(self, store: redis.Redis, backend: Backend):
        self.store, self.backend = store, backend
        self._tokens_per_byte = 0.0  # the most this backend's replies have shown
        self._book = store.register_script(_BOOK) if backend.budget else None
        self._lock = threading.Lock()
        self._tally: dict[tuple[int, str], list[int]] = {}  # (hour, job) -> FIELDS
        self._batches: dict[str, list[int]] = {}  # batch -> FIELDS (`flush_batch` writes one)
        self._held: dict[int, list[int]] = {}  # hour -> bookings to give back (tokens, cost)
        self._last = time.monotonic()
        self._scheduled = False  # a flush is due on the flushing thread

    @property
    def has_budget(self) -> bool:
        """Whether calls book their estimate first (`book`): only under a `[budget]`."""
        return self._book is not None

    def bound(self, input_bytes: int, tokens_out: float, learned: bool = True) -> Usage:
        """The most a call of `input_bytes` that may write `tokens_out` tokens can cost (with
        `learned=False`: at one token a byte, whatever replies have shown)."""
        ratio = min(1.0, self._tokens_per_byte * BOUND_MARGIN) \
            if learned and self._tokens_per_byte else 1.0
        return Usage.estimate(input_bytes * ratio, tokens_out)

    def observe(self, input_bytes: int, tokens_in: int) -> None:
        """A reply's `usage`: what its input cost per byte."""
        if input_bytes > 0 and tokens_in > 0:
            self._tokens_per_byte = max(self._tokens_per_byte, tokens_in / input_bytes)

    def book(self, estimate: Usage) -> Booking | None:
        """Book a call's estimate against the budget; BudgetExceeded (naming the cap) when it
        would pass one. None without a budget."""
        budget = self.backend.budget
        if self._book is None or budget is None:
            return None
        hour, cost = hour_now(), estimate.cost_micro(self.backend)
        tokens = estimate.tokens_in + estimate.tokens_out
        caps = [_cap_arg(budget, name) for name in CAPS]
        refused = self._book(keys=[keys.spend(self.backend.name), keys.spend(self.backend.name,
                                                                              hour)],
                             args=[tokens, cost, *caps, HOUR_KEEP_S])
        if refused:
            name = CAPS[int(refused[0]) - 1]
            raise BudgetExceeded(self.backend.name, name, getattr(budget, name),
                                 _shown(name, float(refused[1])),
                                 _shown(name, cost if name.startswith("cost") else tokens))
        return Booking(hour, tokens, cost)

    def spent(self, usage: Usage, booking: Booking | None, batch_id: str | None,
              job: str = DEFAULT_JOB) -> None:
        """Add one call's usage, to its backend, batch and job (and give back its booking);
        written within FLUSH_EVERY_S."""
        values = (1, usage.tokens_in, usage.tokens_out, int(usage.estimated),
                  usage.cost_micro(self.backend))
        with self._lock:
            tallies = [self._tally.setdefault((hour_now(), job), [0] * len(FIELDS))]
            if batch_id is not None:
                tallies.append(self._batches.setdefault(batch_id, [0] * len(FIELDS)))
            for tally in tallies:
                _sum_into(tally, values)
            if booking is not None:
                _sum_into(self._held.setdefault(booking.hour, [0, 0]),
                          (booking.tokens, booking.cost_micro))
            schedule, self._scheduled = not self._scheduled, True
            due = self._last + FLUSH_EVERY_S
        if schedule:  # never on the caller's thread: it may be the worker's call loop
            flushing.flush_at(self, due)

    def flush(self) -> None:
        """Write what was added now (one round trip); kept for the next write if Redis is
        away."""
        flushing.write([self])

    def stage(self, pipe: Any) -> flushing.Written | None:
        """Queue the writes of what was added on `pipe` (see `flushing.Flushable`)."""
        with self._lock:
            tally, held, batches = self._tally, self._held, self._batches
            self._tally, self._held, self._batches = {}, {}, {}
            self._last, self._scheduled = time.monotonic(), False
        return self._staged(pipe, tally, held, batches)

    def stage_batch(self, batch_id: str, pipe: Any) -> flushing.Written | None:
        """Queue the writes of one batch's share of what was added on `pipe` (the backend's
        and jobs' totals go with the next flush): what a reader of the batch's outcomes
        sums, a few commands in the round trip that records them."""
        with self._lock:
            values = self._batches.pop(batch_id, None)
        return None if values is None else self._staged(pipe, {}, {}, {batch_id: values})

    def _staged(self, pipe: Any, tally: dict[tuple[int, str], list[int]],
                held: dict[int, list[int]], batches: dict[str, list[int]]
                ) -> flushing.Written | None:
        if not tally and not held and not batches:
            return None
        name = self.backend.name
        for (hour, job), values in tally.items():
            pipe.sadd(keys.JOBS, job)
            for key in (keys.spend(name), keys.spend(name, hour), keys.job_spend(job),
                        keys.job_spend(job, hour)):
                _add(pipe, key, "", values)
            pipe.expire(keys.spend(name, hour), HOUR_KEEP_S)  # once written: it exists
            pipe.expire(keys.job_spend(job, hour), HOUR_KEEP_S)
        for batch_id, values in batches.items():
            _add(pipe, keys.batch_spend(batch_id), f"{name}:", values)
            pipe.expire(keys.batch_spend(batch_id), BATCH_KEEP_S)
        for hour, (tokens, cost) in held.items():  # the bookings these calls held
            pipe.hincrby(keys.spend(name, hour), "held_tokens", -tokens)
            pipe.hincrby(keys.spend(name, hour), "held_cost_micro", -cost)

        def written(ok: bool) -> None:
            if not ok:  # added to what the next write takes
                with self._lock:
                    _keep(self._tally, tally)
                    _keep(self._batches, batches)
                    _keep(self._held, held)
        return written


def _keep(mine: dict[_K, list[int]], unwritten: dict[_K, list[int]]) -> None:
    """Add what a failed write held back to what the next write takes."""
    for slot, values in unwritten.items():
        _sum_into(mine.setdefault(slot, [0] * len(values)), values)


def _sum_into(total: list[int], values: Sequence[int]) -> None:
    for k, value in enumerate(values):
        total[k] += value


def _add(pipe: Any, key: str, prefix: str, values: list[int]) -> None:
    for field, value in zip(FIELDS, values, strict=True):
        if value:
            pipe.hincrby(key, prefix + field, value)


def _cap_arg(budget: Budget, name: str) -> str:
    value = getattr(budget, name)
    if value is None:
        return ""
    # round: int() would drop a micro unit where the float is a hair short (0.0157 * 1e6)
    return str(round(value * 1_000_000)) if name.startswith("cost") else str(int(value))


def _shown(name: str, value: float) -> float:
    """A Lua-side figure in the cap's own unit (cost caps are held in micro units)."""
    return value / 1_000_000 if name.startswith("cost") else value


def _hgetall(store: redis.Redis, key: str) -> dict[bytes, bytes]:
    # redis-py types replies bytes | str; a client without decode_responses gets bytes
    return store.hgetall(key)  # type: ignore[return-value]


def _figures(raw: dict[bytes, bytes]) -> dict[str, Any]:
    got = {k.decode(): int(v) for k, v in raw.items()}
    return {"calls": got.get("calls", 0), "tokens_in": got.get("tokens_in", 0),
            "tokens_out": got.get("tokens_out", 0), "estimated_calls": got.get("estimated", 0),
            "cost": got.get("cost_micro", 0) / 1_000_000}


def backend_spend(store: redis.Redis, backend: Backend) -> dict[str, Any]:
    """A backend's spend in total and this hour, and each budget cap's use and what is left."""
    total_raw, hour_raw = (_hgetall(store, keys.spend(backend.name)),
                           _hgetall(store, keys.spend(backend.name, hour_now())))
    total, hour = _figures(total_raw), _figures(hour_raw)
    held = {k.decode(): int(v) for k, v in hour_raw.items() if k.startswith(b"held_")}
    held_t, held_c = held.get("held_tokens", 0), held.get("held_cost_micro", 0) / 1_000_000
    used = {
        "tokens_per_hour": hour["tokens_in"] + hour["tokens_out"] + held_t,
        "tokens_total": total["tokens_in"] + total["tokens_out"] + held_t,
        "cost_per_hour": hour["cost"] + held_c,
        "cost_total": total["cost"] + held_c,
    }
    caps = backend.budget.limits() if backend.budget else {}
    budgets = {name: {"limit": cap, "used": round(used[name], 6),
                      "left": round(max(0.0, cap - used[name]), 6)} for name, cap in caps.items()}
    return {"total": total, "this_hour": hour, "budgets": budgets}


def batch_spend(store: redis.Redis, batch_id: str) -> dict[str, dict[str, Any]]:
    """One batch's spend per backend (calls, tokens_in, tokens_out, estimated_calls, cost)."""
    by_backend: dict[str, dict[bytes, bytes]] = {}
    for key, value in _hgetall(store, keys.batch_spend(batch_id)).items():
        backend, _, field = key.decode().rpartition(":")
        by_backend.setdefault(backend, {})[field.encode()] = value
    return {backend: _figures(raw) for backend, raw in sorted(by_backend.items())}
