"""Plan a batch over a route: which backend scores which samples, in chunks of what size.

Pure functions: rates and queue depths come in as arguments (`capacity.of` reads them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..backends import make_backend
from ..config.model import Backend, Config, Route
from ..errors import InvalidSamples


@dataclass(frozen=True)
class Chunk:
    """Samples (by input index) that one task scores on one backend."""

    backend: str
    indices: list[int]


_Item = TypeVar("_Item")


def spread(
    indices: list[_Item], route: Route, shares: list[float] | None = None
) -> dict[str, list[_Item]]:
    """Deal `indices` (or units of them) to the route's backends in proportion to `shares`
    (default: weights).

    Smooth weighted round robin, so every backend's share is interleaved through the batch.
    """
    shares = list(shares or route.weights)
    if not any(share > 0 for share in shares):
        shares = [1.0] * len(shares)
    total = sum(shares)
    current = [0.0] * len(shares)
    dealt: dict[str, list[_Item]] = {name: [] for name in route.backends}
    for index in indices:
        for k, share in enumerate(shares):
            current[k] += share
        best = max(range(len(shares)), key=current.__getitem__)
        current[best] -= total
        dealt[route.backends[best]].append(index)
    return dealt


MAX_CHUNK = 64  # samples per judge task: big enough to amortise a task, small enough to spread
CHUNK_SECONDS = 0.25  # at the backend's rate a chunk takes at most this long (priority
# switches, and fair shares between jobs: a job's share of a queue is counted in whole chunks)
CHUNKS_PER_BATCH = 16  # a batch is cut into at least this many chunks per backend, when it can


def chunk_size(backend: Backend, n: int) -> int:
    """Samples per task for `n` samples on `backend`: its `chunk_size` when set, else sized so
    that a chunk is about one round of the worker's calls in flight (`pool.calls`) and at most
    CHUNK_SECONDS of the backend's rate: a task is then short, so a `val` batch never waits
    long for a worker slot, and the batch still splits over every pool; never fewer than fill
    the worker's calls with the `pool.concurrency` chunks it runs at once (a micro-batch of a
    few samples is one task: its calls run at once in it, and each task more would cost the
    worker more than a call).

    >>> from qreward_queue.backends import JudgeOptions
    >>> judge = Backend("j", "judge", options=JudgeOptions(url="http://judge/v1", model="m"))
    >>> chunk_size(judge, 4096), chunk_size(judge, 40), chunk_size(judge, 5)
    (64, 16, 16)
    """
    if backend.chunk_size:
        return backend.chunk_size
    # at least enough to fill the worker's calls with the chunk tasks it runs at once: a
    # chunk's calls run concurrently, and a task costs more of a worker than a call
    fill = math.ceil(backend.pool.calls / max(1, backend.pool.concurrency))
    size = min(MAX_CHUNK, backend.pool.calls, max(fill, math.ceil(n / CHUNKS_PER_BATCH)))
    if backend.limits.rpm:
        size = min(size, math.ceil(backend.limits.rpm / 60 * CHUNK_SECONDS))
    per_call = make_backend(backend).samples_per_call  # whole calls per task
    return max(1, per_call * max(1, size // per_call))


def grouped(config: Config, route: Route) -> bool:
    """The route's backends judge whole groups (the loader gives a route one mode)."""
    return make_backend(config.backend(route.backends[0])).grouped


def units(config: Config, route: Route, samples: Sequence[dict[str, Any]],
          indices: list[int]) -> list[list[int]]:
    """`indices` in the units the route's kind keeps in one call (a judge's groups; else one
    sample each). The loader gives a route backends of one mode, so its first one speaks."""
    client = make_backend(config.backend(route.backends[0]))
    try:
        local = client.units([samples[i] for i in indices])
    except InvalidSamples as exc:  # named by their places in the batch
        raise InvalidSamples({indices[k]: why for k, why in exc.problems.items()}) from None
    return [[indices[k] for k in unit] for unit in local]


def plan(
    config: Config, route: Route, indices: list[int], shares: list[float] | None = None,
    whole: list[list[int]] | None = None,
) -> list[Chunk]:
    """Chunks of each backend's chunk size, interleaved across backends. `whole`: `indices`
    in units (see `units`) that go to one backend, in one chunk, each."""
    return plan_dealt(config, spread(whole or [[i] for i in indices], route, shares))


def plan_dealt(config: Config, dealt: dict[str, list[list[int]]]) -> list[Chunk]:
    """Chunks of the units dealt to each backend, of its chunk size, interleaved."""
    per_backend = []
    for name, mine in dealt.items():
        backend = config.backend(name)
        size = chunk_size(backend, sum(map(len, mine)))
        # a size the planner chose is a cap: evened out, a batch leaves no short last chunk
        # (it would take a worker's turn for a few samples, and tip a job's fair share)
        per_call = 0 if backend.chunk_size else make_backend(backend).samples_per_call
        per_backend.append([Chunk(name, part) for part in pack(mine, size, per_call)])
    chunks: list[Chunk] = []
    for row in range(max((len(c) for c in per_backend), default=0)):
        chunks.extend(c[row] for c in per_backend if row < len(c))
    return chunks


def pack(whole: Sequence[Sequence[_Item]], size: int, per_call: int = 0) -> list[list[_Item]]:
    """Consecutive units in chunks of at most `size` items (a larger unit: a chunk alone);
    with `per_call`, evened out: each chunk holds an even part of what is left, in whole calls
    of `per_call` items (`size` is a multiple), so that no chunk is much shorter than the rest.

    >>> pack([[0, 1], [2], [3, 4, 5], [6]], 3)
    [[0, 1, 2], [3, 4, 5], [6]]
    >>> pack([[i] for i in range(10)], 4), pack([[i] for i in range(10)], 4, per_call=1)
    ([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]], [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]])
    """
    chunks: list[list[_Item]] = []
    left, cap = sum(map(len, whole)), size
    for unit in whole:
        if chunks and len(chunks[-1]) + len(unit) <= cap:
            chunks[-1].extend(unit)
        else:
            if per_call and left:  # (only empty units left: any cap)
                calls, chunks_left = math.ceil(left / per_call), math.ceil(left / size)
                cap = per_call * math.ceil(calls / chunks_left)
            chunks.append(list(unit))
        left -= len(unit)
    return chunks


def water_fill(n: int, rates: list[float], queued: list[float]) -> list[float]:
    """Split `n` new samples so every backend drains its queue plus its share at the same time.

    >>> water_fill(60, [10, 20, 30], [0, 0, 0])
    [10.0, 20.0, 30.0]
    >>> water_fill(10, [10, 10], [20, 0])
    [0.0, 10.0]
    """
    active, finish = [i for i, r in enumerate(rates) if r > 0], 0.0
    while active:
        finish = (n + sum(queued[i] for i in active)) / sum(rates[i] for i in active)
        behind = [i for i in active if rates[i] * finish < queued[i]]
        if not behind:
            break
        active = [i for i in active if i not in behind]
    shares = [0.0] * len(rates)
    for i in active:
        shares[i] = rates[i] * finish - queued[i]
    return shares


def failover_target(candidates: list[str], rates: list[float], queued: list[float],
                    n: int) -> str:
    """The sibling that would finish `n` more samples soonest (open circuits, rate 0, last).

    >>> failover_target(["a", "b"], [10, 10], [50, 0], 5)
    'b'
    """
    shares = water_fill(n, rates, queued)
    return candidates[max(range(len(candidates)), key=shares.__getitem__)]
