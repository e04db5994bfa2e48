"""Ctrl-C always cancels (issue 34): `qrq score` interrupted while it reads, publishes or
waits writes a line per sample and exits 130, and nothing it published makes a judge call
(before: Ctrl-C during submission printed `Aborted!`, exited 1, wrote nothing, and the
published chunks were judged until the lease lapsed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import redis
from support import ROOT, PrivateRedis, judge_backend, start_workers, wait_for, write_config

from qreward_queue import keys
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn


@pytest.fixture
def redis_url(tmp_path):
    """A Redis of the test's own: the moments below are keys appearing in Redis, and a
    process another test left behind must not make one appear early in a shared database."""
    server = PrivateRedis(tmp_path).start()
    yield server.url
    server.kill()

SAMPLES = 60_000


def first_key(client: redis.Redis, pattern: str) -> bytes | None:
    return next(iter(client.scan_iter(match=pattern, count=10_000)), None)


MOMENTS = {
    # the first line it prints: it is starting, reading or checking the file now
    "starting": lambda proc, client: proc.stderr.readline(),
    # the batch's lease exists: the chunks are being published
    "publishing": lambda proc, client: wait_for(
        lambda: first_key(client, keys.lease("*")), 60, "the lease", interval_s=0.002),
    # the batch's sentinel exists: everything is published, it waits for outcomes
    "waiting": lambda proc, client: wait_for(
        lambda: first_key(client, keys.batch_sentinel("*")), 60, "the sentinel",
        interval_s=0.002),
}


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_ctrl_c_of_qrq_score_cancels_what_it_published_and_writes_every_line(
    moment, tmp_path, redis_url, redis_client, stack
):
    # Given a judge, a 60,000-line file and no worker yet (so nothing is judged before the
    # interrupt: every call the judge ever gets would be one the interrupt failed to stop)
    judge = stack.enter_context(spawn(MockJudgeSettings(latency_ms=5)))
    config_path = write_config(tmp_path, {"j": judge_backend(judge.url)}, redis_url=redis_url)
    in_file = tmp_path / "in.jsonl"
    in_file.write_text("".join(json.dumps({"prompt": f"q{i}", "response": f"a{i}", "id": i})
                               + "\n" for i in range(SAMPLES)))
    out_file = tmp_path / "out.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("QRQ_REDIS_URL", "QRQ_CONFIG")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "qreward_queue.cli", "score", str(in_file), "-o", str(out_file),
         "--route", "j", "--config", str(config_path)],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stack.callback(proc.kill)
    # When Ctrl-C reaches it at that moment
    MOMENTS[moment](proc, redis_client)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    # Then it exits 130 with a line for every sample (read so far, when it was still
    # reading), in order, none scored
    assert proc.returncode == 130, err[-2000:]
    assert "Aborted!" not in err
    written = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [o["id"] for o in written] == list(range(len(written))), err[-2000:]
    assert moment == "starting" or len(written) == SAMPLES
    assert {o["status"] for o in written} <= {"cancelled"}, err[-2000:]
    # and whatever it published says cancelled, so a worker started now drops it all unjudged
    lease = first_key(redis_client, keys.lease("*"))
    assert lease is None or redis_client.get(lease) == b"cancelled", moment
    queued = sum(redis_client.llen(k) for k in keys.queue_lists("qrq.j"))
    assert moment == "starting" or (redis_client.get(lease) == b"cancelled" and queued), moment
    (worker,) = start_workers(config_path, [("j", f"after-{moment}@interrupt")])
    stack.callback(worker.kill)
    wait_for(lambda: not any(redis_client.llen(k) for k in keys.queue_lists("qrq.j"))
             and not redis_client.hlen("qrq:unacked"), 120, "the queue to drain")
    assert judge.stats()["requests"] == 0


def test_a_keyboard_interrupt_inside_submit_batch_cancels_what_it_published(
    tmp_path, redis_url, redis_client, stack
):
    # Given a judge, no worker yet, and Ctrl-C due as soon as the batch's lease appears (the
    # chunks are being published then)
    import _thread
    import threading

    import qreward_queue

    judge = stack.enter_context(spawn(MockJudgeSettings(latency_ms=5)))
    config_path = write_config(tmp_path, {"j": judge_backend(judge.url)}, redis_url=redis_url)
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    samples = [{"prompt": f"q{i}", "response": f"a{i}"} for i in range(SAMPLES)]

    def interrupt_when_publishing() -> None:
        wait_for(lambda: first_key(redis_client, keys.lease("*")), 60, "the lease",
                 interval_s=0.002)
        _thread.interrupt_main()

    threading.Thread(target=interrupt_when_publishing, daemon=True).start()
    # When submit_batch is interrupted there, it raises KeyboardInterrupt...
    with pytest.raises(KeyboardInterrupt):
        qreward_queue.submit_batch(samples, route="j", app=app)
    # ...having cancelled what went out: a worker started now drops it all unjudged
    assert redis_client.get(first_key(redis_client, keys.lease("*"))) == b"cancelled"
    (worker,) = start_workers(config_path, [("j", "after@submit-interrupt")])
    stack.callback(worker.kill)
    wait_for(lambda: not any(redis_client.llen(k) for k in keys.queue_lists("qrq.j"))
             and not redis_client.hlen("qrq:unacked"), 120, "the queue to drain")
    assert judge.stats()["requests"] == 0
