"""Outcomes reach the trainer as samples finish, not as their chunk does: real Redis, a real
`qrq worker` and the mock judge, whose `[[mock:hang]]` sample answers hang_s late."""

from __future__ import annotations

import asyncio
import time
from functools import partial

import pytest
import redis
from support import (
    PrivateRedis,
    Worker,
    backend_of,
    expected,
    judge_backend,
    wait_for,
    write_config,
)

import qreward_queue as qrq
from qreward_queue import keys
from qreward_queue.broker import records
from qreward_queue.flow.spend import Ledger, Usage, batch_spend
from qreward_queue.testing.mock_judge import MockJudge, MockJudgeSettings
from qreward_queue.trainer.batcher import MicroBatcher

SLOW = 3  # the index of the sample the judge answers late
CHUNK = 8


def one_chunk(tag: str) -> list[dict]:
    """A chunk's samples, the SLOW one hanging in the judge; ids to check each caller's own."""
    return [{"prompt": f"{tag} {i}", "id": i,
             "response": "[[mock:hang]]" if i == SLOW else f"answer {i}"} for i in range(CHUNK)]


@pytest.fixture
def slow_stack(stack, tmp_path, redis_url):
    return start_slow_stack(stack, tmp_path, redis_url)


def start_slow_stack(stack, tmp_path, redis_url):
    judge = stack.enter_context(MockJudge(MockJudgeSettings(latency_ms=5, latency_cv=0,
                                                            hang_s=4)))
    config_path = write_config(tmp_path, {"j": judge_backend(judge.url, chunk_size=CHUNK)},
                               redis_url=redis_url, deadline_s=60)
    with config_path.open("a") as fh:  # a cached route over the same judge
        fh.write('[routes.cached]\nbackends = ["j"]\ncache = true\n')
    stack.enter_context(Worker(config_path, "j"))
    return qrq.configure(qrq.load_config(config_path))


def test_a_chunks_fast_samples_arrive_before_its_slow_one_and_stay_as_they_came(slow_stack):
    app = slow_stack
    samples = [*one_chunk("early"), dict(one_chunk("early")[0], id="copy")]  # a copy of 0
    fast = [i for i in range(CHUNK) if i != SLOW]
    batch = qrq.submit_batch(samples, route="cached", app=app)

    def fast_ones_in():
        batch.completed  # noqa: B018 - a poll
        seen = batch.partial()
        return seen if all(seen[i] is not None for i in fast) else None

    early = wait_for(fast_ones_in, 30, "the fast samples' outcomes")
    # the slow sample is still in its judge call: its chunk has not finished
    assert early[SLOW] is None and not batch.done()
    assert early[CHUNK].score == early[0].score and early[CHUNK].id == "copy"
    # their scores are cached already: the same samples again come back at once from the cache
    again = qrq.submit_batch([samples[i] for i in fast], route="cached", app=app)
    assert [o.status for o in again.outcomes(timeout=5)] == ["cached"] * len(fast)
    final = batch.outcomes()
    assert [final[i] for i in fast] == [early[i] for i in fast]  # the chunk's result agrees
    assert final[CHUNK] == early[CHUNK]
    for i, outcome in enumerate(final):
        assert (outcome.status, outcome.score) == ("ok", expected(app, "j", samples[i])), i


def test_the_client_sleeps_in_redis_while_nothing_finishes(stack, tmp_path):
    """No poll rounds: while only the slow sample is out, the process's one reader blocks in
    Redis and reads again only for its liveness look (every 2 s), not every few ms. A Redis
    of the test's own: its server-wide count of reads is then this reader's alone."""
    server = PrivateRedis(tmp_path).start()
    stack.callback(server.kill)
    app = start_slow_stack(stack, tmp_path, server.url)
    redis_client = redis.Redis.from_url(server.url)
    stack.callback(redis_client.close)
    batch = qrq.submit_batch(one_chunk("quiet"), route="j", app=app)
    wait_for(lambda: sum(o is not None for o in batch.partial()) == CHUNK - 1, 30,
             "the fast samples' outcomes")
    before = xreads(redis_client)
    time.sleep(2.5)  # a window to count the reader's reads in (the hang lasts 4 s)
    reads = xreads(redis_client) - before
    assert not batch.done()
    assert reads <= 4, reads  # 20 ms poll rounds would have made ~125 reads
    assert batch.outcomes()[SLOW].status == "ok"


def xreads(client) -> int:
    """XREAD commands the Redis server has answered."""
    return client.info("commandstats").get("cmdstat_xread", {}).get("calls", 0)


def test_a_finished_batch_tells_workers_so_and_leaves_no_result_behind(slow_stack, redis_url):
    """Both writes ride on the reader's next read, with no round trip of their own."""
    app = slow_stack
    samples = [s for i, s in enumerate(one_chunk("finished")) if i != SLOW]
    batch = qrq.submit_batch(samples, route="j", app=app)
    assert all(o.status == "ok" for o in batch.outcomes(timeout=30))
    client = redis.Redis.from_url(redis_url)
    wait_for(lambda: client.get(keys.lease(batch.batch_id)) == b"done", 10, "the lease's end")
    wait_for(lambda: not list(client.scan_iter("qrq:celery-task-meta-*")), 10,
             "the read results dropped")
    client.close()


def test_each_micro_batched_caller_gets_its_own_sample_when_it_is_scored(slow_stack):
    app = slow_stack
    batcher = MicroBatcher(max_items=CHUNK, max_wait_ms=50)  # the CHUNK samples: one batch
    samples = one_chunk("caller")

    async def callers():
        calls = [asyncio.ensure_future(batcher.score(s, route="j")) for s in samples]
        await asyncio.wait([c for i, c in enumerate(calls) if i != SLOW])
        slow_done_early = calls[SLOW].done()
        return slow_done_early, await asyncio.gather(*calls)

    slow_done_early, outcomes = asyncio.run(callers())
    assert batcher.batches_sent == 1
    assert not slow_done_early  # every other caller had its score while the slow one hung
    for sample, outcome in zip(samples, outcomes, strict=True):
        assert outcome.id == sample["id"]
        assert (outcome.status, outcome.score) == ("ok", expected(app, "j", sample))


def test_an_outcome_is_announced_after_its_calls_spend_is_written(redis_client):
    """A batch's summary read right after its last outcome counts every call behind it: the
    recorder writes the ledger's spend before the outcomes it announces."""
    ledger = Ledger(redis_client, backend_of("judge", name="j", url="http://judge.invalid/v1",
                                           model="m"))
    recorder = records.Recorder(redis_client, "client1.b2", None,
                                paid=partial(ledger.stage_batch, "client1.b2"))
    ledger.spent(Usage(120, 8), None, "client1.b2")
    recorder.record_all({0: {"score": 0.5, "status": "ok"}})
    # no flush of the ledger by hand: whichever of the two the flusher takes first, the
    # outcome's arrival finds the call counted
    records.read_inbox(redis_client, keys.inbox("client1.b2"), b"0-0", 5000)
    assert batch_spend(redis_client, "client1.b2")["j"]["calls"] == 1
    ledger.flush()  # the backend's totals now, not on the flushing thread during a later test


def test_a_recorder_writes_the_last_record_of_a_burst_without_another(redis_client):
    recorder = records.Recorder(redis_client, "client1.b1", None)
    inbox = keys.inbox("client1.b1")
    recorder.record(5, {"score": 0.5, "status": "ok"})
    recorder.record(7, {"score": 0.7, "status": "ok"})
    # no flush() and no later record: the process's flusher writes them within FLUSH_EVERY_S;
    # the reader sleeps in Redis until they come (one entry: the flush)
    after, (entry,) = records.read_inbox(redis_client, inbox, b"0-0", 5000)
    assert entry.batch_id == "client1.b1" and entry.task_id is None
    assert sorted(entry.records) == [(5, {"score": 0.5, "status": "ok"}),
                                     (7, {"score": 0.7, "status": "ok"})]
    assert records.read(redis_client, "client1.b1", [5, 6, 7]) == {
        5: {"score": 0.5, "status": "ok"}, 7: {"score": 0.7, "status": "ok"}}
    assert redis_client.ttl(inbox) > 0
    # read from where it left off: nothing new (and what was read is trimmed away)
    assert records.read_inbox(redis_client, inbox, after, 0) == (after, [])
    assert redis_client.xlen(inbox) <= 1
