"""A dead caller stops costing: a client killed with SIGKILL stops renewing its batch's lease,
and the workers make no call for that batch once the lease time has passed.

Real Redis, a real `qrq worker`, a client in its own process, the mock judge's own request
counter as the truth.
"""

from __future__ import annotations

import subprocess
import sys
import time

from support import ROOT, judge_backend, start_workers, wait_for, write_config

from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn

LEASE_S = 6.0
CLIENT = """
import sys, qreward_queue
app = qreward_queue.configure(qreward_queue.load_config(sys.argv[1]))
samples = [{"prompt": f"lease question {i}", "response": f"answer {i}"} for i in range(2000)]
batch = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=600)
print("submitted", flush=True)
batch.get()
"""


def test_workers_stop_calling_for_a_killed_client_within_the_lease(tmp_path, redis_url, stack):
    # Given a slow judge (~500 ms a call), one worker making 16 calls at once (~30/s, so a
    # batch of 2,000 takes over a minute) and a lease of 6 s
    judge = stack.enter_context(spawn(MockJudgeSettings(latency_ms=500, latency_cv=0.1)))
    config_path = write_config(
        tmp_path, {"j": judge_backend(judge.url, concurrency=2, calls=16)},
        redis_url=redis_url, lease_s=LEASE_S,
    )
    (worker,) = start_workers(config_path, [("j", "lease@test")])
    stack.callback(worker.kill)
    client = subprocess.Popen([sys.executable, "-c", CLIENT, str(config_path)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    stack.callback(lambda: client.poll() is None and client.kill())
    assert client.stdout.readline().strip() == "submitted"
    # When the client is killed with SIGKILL 3 s into the batch
    time.sleep(3)
    client.kill()
    client.wait(10)
    killed, calls_at_kill = time.monotonic(), judge.stats()["requests"]
    assert calls_at_kill > 20, "the batch had not started: the test proves nothing"
    # Then the judge's request counter stops growing within the lease time + 2 s...
    last, last_grew = calls_at_kill, killed
    while time.monotonic() < killed + LEASE_S + 6:
        now = judge.stats()["requests"]
        if now != last:
            last, last_grew = now, time.monotonic()
        time.sleep(0.1)
    stopped_after = last_grew - killed
    print(f"calls at kill {calls_at_kill}, in all {last} of 2000; "
          f"the last call came {stopped_after:.1f} s after the kill (lease {LEASE_S:g} s)")
    assert stopped_after <= LEASE_S + 2, stopped_after  # deadline promise: the lease
    assert last < 2000 // 3, last
    # ...and the worker drops the batch's queued chunks (their tasks end without a call)
    wait_for(lambda: "succeeded" in worker.log.read_text(), 30, "the dropped chunks")
    assert judge.stats()["requests"] == last
