"""Redis is no single point of failure: a Sentinel failover mid-batch loses no reward.

A real primary, one replica and three `redis-sentinel`s on loopback ports of their own
(tests/sentinel_cluster.py), real `qrq worker` processes and a mock judge enforcing the same
rate limit as the backend's. The primary is SIGKILLed (or frozen with SIGSTOP) mid-batch; the
sentinels promote the replica within a few seconds and every qrq connection follows it.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
from sentinel_cluster import SERVICE, PromotionWatch, SentinelCluster
from sentinel_freeze import JudgeTimeline, run_freeze
from support import (
    close_half_closed_channel,
    expected,
    judge_backend,
    start_workers,
    tasks_received,
    wait_for,
    write_config,
)

import qreward_queue
from qreward_queue.broker.app import STORE_CONNECTION
from qreward_queue.config import redis_conn
from qreward_queue.config.redis_conn import check_redis
from qreward_queue.errors import RedisUnreachable
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn

N = 2000
RPM = 4800  # 80 requests/s: the judge's limit and the backend's, so the limiter is what binds
FALLBACK = -1.0


@pytest.mark.slow
def test_a_sentinel_failover_mid_batch_loses_no_reward(tmp_path, stack):
    # Given a Sentinel group, a judge allowing 80 requests/s and two workers limited to that
    cluster = SentinelCluster(tmp_path).start()
    stack.callback(cluster.stop)
    judge = stack.enter_context(spawn(MockJudgeSettings(latency_ms=20, latency_cv=0.2, rpm=RPM)))
    config_path = write_config(
        tmp_path, {"j": judge_backend(judge.url, rpm=RPM, concurrency=8)},
        fallback_score=FALLBACK,
    )
    with config_path.open("a") as fh:
        fh.write(f'[redis]\nurl = "{cluster.url}"\nservice_name = "{SERVICE}"\n')
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    check_redis(app.qrq_config)
    workers = start_workers(config_path, [("j", f"w{i}@failover") for i in range(2)])
    for worker in workers:
        stack.callback(worker.kill)
    timeline = JudgeTimeline(judge)
    stack.callback(timeline.stop)
    samples = [{"prompt": f"failover question {i}", "response": f"answer {i}"} for i in range(N)]
    # When the primary is SIGKILLed once about a third of the batch is scored
    started = time.monotonic()
    batch = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=80)
    wait_for(lambda: batch.completed >= N // 3, timeout_s=40, what="a third of the batch")
    old_primary = cluster.primary()
    done_at_kill, killed = batch.completed, time.monotonic()
    assert done_at_kill < N - 200, "the batch finished before the primary could be killed"
    cluster.kill(old_primary[1])
    wait_for(lambda: batch.completed > done_at_kill, timeout_s=30, what="a sample after failover")
    recovered, done_at_recovery = time.monotonic(), batch.completed
    # (the sentinel asked may learn of the promotion a moment after the one qrq asked)
    wait_for(lambda: cluster.primary() != old_primary, timeout_s=30,
             what="the sentinels naming a new primary")
    new_primary = cluster.primary()
    outcomes = batch.outcomes()
    finished = time.monotonic()
    timeline.stop()
    # Then every sample is scored, right, within its deadline; nothing lost
    assert new_primary != old_primary
    assert len(outcomes) == N and all(o is not None for o in outcomes)
    statuses = {o.status for o in outcomes}
    assert statuses == {"ok"}, [o for o in outcomes if o.status != "ok"][:3]
    for i, (sample, outcome) in enumerate(zip(samples, outcomes, strict=True)):
        assert outcome.score == expected(app, "j", sample), (i, outcome)
    # the limiter still held the judge's limit: in the first 5 s after the failover the judge
    # saw at most 5% more than its limit allows (its 1 s bucket included) and refused nothing
    window_s, rate = 5.0, RPM / 60
    (req0, refused0), (req1, refused1) = timeline.at(recovered), timeline.at(recovered + window_s)
    assert req1 - req0 <= 1.05 * rate * (window_s + 1), (req1 - req0, rate * window_s)
    assert refused1 - refused0 <= 0.05 * (req1 - req0), (refused1 - refused0, req1 - req0)
    stats = judge.stats()
    duplicates = stats["accepted"] - N
    print(
        f"\nfailover: kill -> first sample scored through the new primary "
        f"{recovered - killed:.1f} s; duplicates {duplicates} (judge accepted "
        f"{stats['accepted']} for {N}); 429s {stats['rate_limited']}; samples/s before "
        f"{done_at_kill / (killed - started):.1f}, after "
        f"{(N - done_at_recovery) / (finished - recovered):.1f}; judge requests/s after "
        f"{(timeline.at(finished)[0] - req0) / (finished - recovered):.1f} (limit {rate:.0f}/s, "
        f"{req1 - req0} in the first {window_s:.0f} s); resubmitted {batch.resubmitted}"
    )
    # and every worker is alive and still consuming: a new batch reaches each of them
    logs = "\n".join(w.log.read_text()[-3000:] for w in workers)
    assert all(w.proc.poll() is None for w in workers), logs
    assert "Unrecoverable error" not in logs, logs
    before = [tasks_received(w) for w in workers]
    more = [{"prompt": f"after {i}", "response": str(i)} for i in range(120)]
    after_batch = qreward_queue.submit_batch(more, route="j", app=app, deadline_s=30)
    assert all(o.status == "ok" for o in after_batch.outcomes())
    wait_for(lambda: all(tasks_received(w) > b for w, b in zip(workers, before, strict=True)),
             timeout_s=10, what="every worker consuming after the failover")


FIRST_SAMPLE_BOUND_S = 5.0


@pytest.mark.slow
def test_a_frozen_primary_costs_seconds_and_its_demoted_self_serves_nobody(tmp_path):
    # Given a batch running through two workers on a Sentinel group, when its primary freezes
    # (SIGSTOP: sockets open, no answer) a third of the way, the replica is promoted, and
    # the old primary is thawed once a sample has been scored through the new one
    figures = run_freeze(tmp_path, hold_s=3 * FIRST_SAMPLE_BOUND_S)
    logs = figures.pop("worker_logs")
    print(f"\nfrozen primary: {figures}")
    # Then a sample whose judge call was made after the promotion is scored within seconds
    first = figures["first_sample_after_promotion_s"]
    assert first is not None and first <= FIRST_SAMPLE_BOUND_S, figures
    # and nobody took work from (or read from) the old primary once it was back
    assert figures["old_primary_served"] == [], figures
    # and every sample is scored, right: none lost
    assert figures["statuses"] == {"ok": figures["samples"]}, figures
    assert figures["wrong_scores"] == 0
    assert figures["workers_alive"] and "Unrecoverable error" not in logs, logs


def test_idle_connections_leave_a_primary_that_froze_and_came_back_for_the_new_one(
    tmp_path, stack
):
    # Given qrq's blocking and asyncio clients of a Sentinel group, each with a pooled
    # connection to the primary
    cluster = SentinelCluster(tmp_path, sentinels=3).start()
    stack.callback(cluster.stop)
    config_path = write_config(tmp_path, {})
    with config_path.open("a") as fh:
        fh.write(f'[redis]\nurl = "{cluster.url}"\nservice_name = "{SERVICE}"\n')
    config = qreward_queue.load_config(config_path)
    client = redis_conn.connect(config, **STORE_CONNECTION)
    old_host, old_port = cluster.primary()
    old = redis.Redis(host=old_host, port=old_port)

    async def scenario() -> None:
        aclient = redis_conn.connect_async(config, **STORE_CONNECTION)
        client.set("before", 1)
        await aclient.set("before", 1)
        # When the primary freezes, the replica is promoted, and the old primary comes back,
        # still saying it is the primary (the sentinels demote it seconds later)
        watch = PromotionWatch(cluster)
        stack.callback(watch.stop)
        cluster.freeze(old_port)
        stack.callback(cluster.thaw, old_port)
        watch.wait(30)
        cluster.thaw(old_port)
        assert old.execute_command("ROLE")[0] == b"master"
        # and both clients write again on the connections they pooled before the freeze
        client.set("after", 1)
        await aclient.set("after-async", 1)
        await aclient.aclose()

    asyncio.run(scenario())
    # Then the writes reached the new primary, not the old one
    new_host, new_port = cluster.primary()
    assert (new_host, new_port) != (old_host, old_port)
    assert old.mget("after", "after-async") == [None, None]
    assert old.execute_command("ROLE")[0] == b"master", "demoted before it could be read"
    new = redis.Redis(host=new_host, port=new_port)
    assert new.mget("after", "after-async") == [b"1", b"1"]


def test_an_unknown_service_name_is_a_one_line_error(tmp_path, stack):
    cluster = SentinelCluster(tmp_path, sentinels=1).start()
    stack.callback(cluster.stop)
    config_path = write_config(tmp_path, {})
    with config_path.open("a") as fh:
        fh.write(f'[redis]\nurl = "{cluster.url}"\nservice_name = "no-such-service"\n')
    with pytest.raises(RedisUnreachable) as err:
        check_redis(qreward_queue.load_config(config_path))
    assert str(err.value).startswith(
        f"the sentinels at 127.0.0.1:{cluster.sentinel_ports[0]} know no service named "
        f"'no-such-service' (they know: {SERVICE})"
    )


def test_a_sentinel_channel_closed_after_kombu_dropped_its_client_still_restores_unacked(
    tmp_path, stack
):
    # Given a kombu Sentinel channel holding one unacknowledged message, in the state a lost
    # primary leaves it in when Celery's Connection.collect() is cut short (see kombu_fix)
    cluster = SentinelCluster(tmp_path, sentinels=1).start()
    stack.callback(cluster.stop)
    # When the channel closes (kombu 5.7.0 alone: AttributeError ... 'alt')
    close_half_closed_channel(cluster.url, "failover.kombu", master_name=SERVICE)
    # Then the unacked message is back on its queue, for the next worker
    host, port = cluster.primary()
    assert redis.Redis(host=host, port=port).llen("failover.kombu") == 1
