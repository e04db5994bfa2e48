"""A slow call holds only itself: a chunk whose last call hangs gives its Celery slot back
(the straggler is handed off: its call goes on, its outcome is recorded when it ends, and the
task comes back for it once the call has surely ended), nothing is called twice, and a
limited backend's calls run on the call loop like an unlimited one's."""

from __future__ import annotations

from support import expected, judge_backend, start_workers, wait_for, write_config

import qreward_queue
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn

HANG_S = 20.0  # far above a loaded machine's straggler threshold (4 x median latency)


def samples_for(n: int, tag: str, hang_at: int | None = None) -> list[dict]:
    return [{"prompt": f"{tag} question {i}",
             "response": f"answer {i}" + (" [[mock:hang]]" if i == hang_at else "")}
            for i in range(n)]


def test_a_hung_call_holds_only_itself_and_nothing_is_called_twice(tmp_path, redis_url, stack):
    # Given a limited judge (so every call goes through the global limiter) served by ONE
    # worker that runs ONE chunk task at a time, and a judge whose marked sample hangs 20 s
    judge = stack.enter_context(spawn(MockJudgeSettings(latency_ms=20, hang_s=HANG_S)))
    backend = judge_backend(judge.url, rpm=600_000, max_concurrent=64, concurrency=1, calls=32,
                            timeout_s=40)
    config_path = write_config(tmp_path, {"j": backend}, redis_url=redis_url)
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    (worker,) = start_workers(config_path, [("j", "straggler@test")])
    stack.callback(worker.kill)
    slow = samples_for(32, "slow", hang_at=5)
    first = qreward_queue.submit_batch(slow, route="j", app=app, deadline_s=120)
    stack.callback(first.cancel)
    # When every other call of that chunk has ended
    wait_for(lambda: first.completed >= 31, 60, "the chunk's other 31 samples")
    # Then a batch sent behind it is scored in full while the hung call still hangs: the
    # task gave its slot back instead of waiting for its last call
    quick = samples_for(32, "quick")
    outcomes = qreward_queue.submit_batch(quick, route="j", app=app, deadline_s=60).outcomes()
    assert [o.status for o in outcomes] == ["ok"] * 32, outcomes
    assert first.partial()[5] is None, "the second batch waited for the hung call"
    # and the hung sample's own outcome arrives when its call ends, scored once
    result = first.outcomes()  # within the batch's deadline
    assert [o.status for o in result] == ["ok"] * 32, result
    assert [o.score for o in result] == [expected(app, "j", s) for s in slow]
    assert judge.stats()["requests"] == 64  # nothing called twice
    assert judge.stats()["hangs"] == 1
    # and the task came back for the straggler once its call had surely ended, finding it
    # recorded (the worker's log shows the task handed off, then both tasks succeeded)
    assert worker.log.read_text().count("retry: Retry in") == 1
    wait_for(lambda: worker.log.read_text().count("succeeded in") == 2, 60,
             "the handed-off task to come back and settle")
    assert judge.stats()["requests"] == 64
