"""The asyncio poller and the per-process micro-batcher, against real Redis and real workers."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time

import pytest
from support import wait_for
from trainer_stack import start_stack

import qreward_queue as qrq
from qreward_queue.rewards.basic import exact_match
from qreward_queue.trainer import batcher as batcher_module
from qreward_queue.trainer.batcher import MicroBatcher


def numbered(n: int, tag: str = "m") -> list[dict]:
    return [{"prompt": f"{tag} {i}", "response": f"= {i % 7}", "reference": str(i % 5), "id": i}
            for i in range(n)]


@pytest.fixture
def exact_stack(stack, tmp_path, redis_url):
    app, *_ = start_stack(stack, tmp_path, redis_url, backends=("exact",))
    return app


def test_2000_concurrent_calls_cost_a_few_dozen_batches_and_each_caller_gets_its_own(
        exact_stack):
    samples = numbered(2000)
    batcher = batcher_module.default_batcher()  # qrq.score_one's: 64 samples or 20 ms
    before = batcher.batches_sent

    async def main():
        tasks = [asyncio.create_task(qrq.score_one(s, "exact")) for s in samples]
        cancelled = tasks[::10]  # a tenth of the callers give up while they wait
        await asyncio.sleep(0)
        for task in cancelled:
            task.cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    assert batcher.batches_sent - before <= 48  # cancelled callers are left out before sending
    for i, (sample, result) in enumerate(zip(samples, results, strict=True)):
        if i % 10 == 0:
            assert isinstance(result, asyncio.CancelledError)
            continue
        assert result.status == "ok", (i, result)
        assert result.id == sample["id"]
        assert result.score == exact_match(sample), i


def test_routes_and_priorities_are_never_mixed_in_one_batch(exact_stack, monkeypatch):
    sent = []
    real_submit = batcher_module.submit_batch

    def recording_submit(samples, route=None, priority="train", **kwargs):
        sent.append((route, priority, [s["id"] for s in samples]))
        return real_submit(samples, route=route, priority=priority, **kwargs)

    monkeypatch.setattr(batcher_module, "submit_batch", recording_submit)
    samples = numbered(120)
    keys = [("exact", "train"), ("exact", "val"), (None, "train")]  # None: the default route
    batcher = MicroBatcher(max_items=16, max_wait_ms=30)

    async def main():
        return await asyncio.gather(*(
            batcher.score(s, *keys[i % 3]) for i, s in enumerate(samples)))

    outcomes = asyncio.run(main())
    assert [o.score for o in outcomes] == [exact_match(s) for s in samples]
    for route, priority, ids in sent:
        assert len(ids) <= 16
        assert {keys[i % 3] for i in ids} == {(route, priority)}
    assert sorted(i for *_, ids in sent for i in ids) == list(range(120))


def test_plain_threads_and_several_event_loops_share_one_batcher(exact_stack):
    samples = numbered(64, "t")
    batcher = MicroBatcher(max_items=64, max_wait_ms=50)
    results: dict[int, object] = {}

    def sync_caller(sample):
        results[sample["id"]] = batcher.submit(sample, "exact").result()

    def loop_caller(chunk):
        async def main():
            return await asyncio.gather(*(batcher.score(s, "exact") for s in chunk))
        for sample, outcome in zip(chunk, asyncio.run(main()), strict=True):
            results[sample["id"]] = outcome

    threads = [threading.Thread(target=sync_caller, args=(s,)) for s in samples[:32]]
    threads += [threading.Thread(target=loop_caller, args=(samples[i:i + 8],))
                for i in range(32, 64, 8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results[s["id"]].score for s in samples] == [exact_match(s) for s in samples]
    assert batcher.batches_sent <= 4


def test_awaiting_many_batches_holds_no_thread_per_batch(exact_stack):
    batches = [qrq.submit_batch(numbered(2, f"b{i}"), route="exact") for i in range(300)]
    before = threading.active_count()
    peak = []

    async def main():
        waits = [asyncio.ensure_future(b.outcomes_async()) for b in batches]
        extra = asyncio.ensure_future(batches[0].outcomes_async())  # two awaiters, one batch
        await asyncio.sleep(0.05)
        peak.append(threading.active_count())
        waits[0].cancel()  # cancelling one awaiter leaves the other awaiter of that batch whole
        done = await asyncio.gather(*waits[1:], extra)
        return done, await batches[5]

    done, scores = asyncio.run(main())
    assert peak[0] <= before + 1  # at most the one reader thread
    assert [o.score for o in done[-1]] == [exact_match(s) for s in batches[0].samples]
    assert all(o.status == "ok" for outcomes in done for o in outcomes)
    assert scores == [exact_match(s) for s in batches[5].samples]


def _child_scores(conn, explicit: MicroBatcher) -> None:
    sample = {"prompt": "child", "response": "4", "reference": "4"}
    outcomes = [qrq.score_one_sync(sample, "exact"), explicit.submit(sample, "exact").result()]
    conn.send([(o.status, o.score) for o in outcomes])


def test_a_forked_child_gets_its_own_batchers(exact_stack):
    parent = batcher_module.default_batcher()
    explicit = MicroBatcher(max_items=8, max_wait_ms=10)
    sample = {"prompt": "p", "response": "1", "reference": "2"}
    first = [qrq.score_one_sync(sample, "exact"), explicit.submit(sample, "exact").result()]
    assert [(o.status, o.score) for o in first] == [("ok", 0.0)] * 2
    ctx = multiprocessing.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_scores, args=(sender, explicit))
    child.start()
    assert receiver.poll(60), "the child did not answer"
    assert receiver.recv() == [("ok", 1.0)] * 2
    child.join(10)
    assert batcher_module.default_batcher() is parent and explicit.batches_sent == 1


def test_a_bad_route_fails_every_caller_of_that_flush_with_the_reason(exact_stack):
    batcher = MicroBatcher(max_items=4, max_wait_ms=5)

    async def main():
        return await asyncio.gather(*(batcher.score(s, "nope") for s in numbered(3)),
                                    return_exceptions=True)

    errors = asyncio.run(main())
    assert all(isinstance(e, qrq.UnknownRoute) and "nope" in str(e) for e in errors)


def test_with_its_batches_out_a_batcher_gathers_what_comes_meanwhile(stack, tmp_path,
                                                                      redis_url, monkeypatch):
    # Given a judge that holds its replies, and a batcher allowed one batch out at a time
    _, judge, _ = start_stack(stack, tmp_path, redis_url, backends=("judge",))
    sent: list[list[int]] = []
    real_submit = batcher_module.submit_batch

    def recording_submit(samples, **kwargs):
        sent.append([s["id"] for s in samples])
        return real_submit(samples, **kwargs)

    monkeypatch.setattr(batcher_module, "submit_batch", recording_submit)
    batcher = MicroBatcher(max_items=64, max_wait_ms=0, max_in_flight=1, max_hold_ms=60_000)
    judge.hold(0)
    try:
        samples = numbered(31, "held")
        # When one sample goes out, and 30 more come while its batch is out
        first = batcher.submit(samples[0], "judge")
        wait_for(lambda: sent, 30, "the first batch to be sent")
        rest = [batcher.submit(s, "judge") for s in samples[1:]]
        # Then they wait for it: no second batch while the judge holds the first's reply
        # (half the backend's 1 s call timeout: the first call is still waiting)
        time.sleep(0.5)
        assert len(sent) == 1, sent
        judge.release()
        outcomes = [first.result(60), *(f.result(60) for f in rest)]
    finally:
        judge.release()
    # and go together once it ended, each caller with its own outcome
    assert sent == [[0], list(range(1, 31))]
    assert [o.status for o in outcomes] == ["ok"] * 31
    assert [o.id for o in outcomes] == list(range(31))
    wait_for(lambda: batcher.in_flight == 0, 10, "the batches to be counted over")
