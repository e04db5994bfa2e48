"""Unit tests of the pure planner (qreward_queue/planning/routing.py): how a batch is cut into
chunks. The planner's reads of Redis and failover are tested end to end in
tests/e2e/test_breaker.py."""

from __future__ import annotations

from support import backend_of

from qreward_queue.config.model import Config, Limits, Pool, Route
from qreward_queue.planning.routing import plan


def test_plan_evens_out_the_chunks_it_sizes_itself():
    """A size the planner chose (no `chunk_size`) is a cap: 512 samples at 13 a chunk are
    40 chunks of 12 or 13, not 39 of 13 and one of 5 (a worker's turn for 5 samples, and a
    job holding more than its fair share of the queue at each batch's end)."""
    judge = backend_of("judge", name="j", url="http://judge.invalid/v1", model="m",
                       limits=Limits(rpm=3000), pool=Pool(concurrency=1, calls=16))
    config = Config(redis_url=None, backends={"j": judge}, routes={})
    route = Route(name="j", backends=("j",), weights=(1.0,))
    chunks = plan(config, route, list(range(512)))
    assert [len(c.indices) for c in chunks] == [13] * 32 + [12] * 8
    assert [i for c in chunks for i in c.indices] == list(range(512))
