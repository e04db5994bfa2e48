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
    backend["retry"]["hedge"] = False  # the hung call is waited for, not sent twice
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


def test_a_call_far_slower_than_usual_gets_a_second_call_and_the_first_answer_wins(
        tmp_path, redis_url, stack):
    # Given a limited judge whose replies usually take 20 ms, a call timeout of 60 s, and two
    # samples whose first request hangs for 60 s (a request judging the same text again answers)
    judge = stack.enter_context(spawn(MockJudgeSettings(latency_ms=20, hang_s=60)))
    backend = judge_backend(judge.url, rpm=600_000, max_concurrent=64, concurrency=2, calls=16,
                            timeout_s=60)
    config_path = write_config(tmp_path, {"j": backend}, redis_url=redis_url)
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    (worker,) = start_workers(config_path, [("j", "hedge@test")])
    stack.callback(worker.kill)
    warm = qreward_queue.submit_batch(samples_for(16, "warm"), route="j", app=app)
    assert [o.status for o in warm.outcomes()] == ["ok"] * 16  # the worker knows what is usual
    samples = [dict(s, response=s["response"] + (" [[mock:hang-once]]" if i in (3, 9) else ""))
               for i, s in enumerate(samples_for(16, "hedged"))]
    # When they are scored with a deadline far shorter than the call timeout
    outcomes = qreward_queue.submit_batch(samples, route="j", app=app,
                                          deadline_s=30).outcomes()
    # Then every sample is scored: each hung call got a second call, whose answer won
    assert [o.status for o in outcomes] == ["ok"] * 16, outcomes
    assert [o.score for o in outcomes] == [expected(app, "j", s) for s in samples]
    stats = judge.stats()
    assert stats["hangs"] == 2
    assert stats["requests"] == 16 + 16 + 2  # one second call per hung one, nothing else


def test_no_second_call_when_the_backend_file_says_hedge_false(tmp_path, redis_url, stack):
    # Given the same judge, its file saying `[retry] hedge = false`, and one sample whose first
    # request hangs for 6 s (the call timeout is 60 s)
    judge = stack.enter_context(spawn(MockJudgeSettings(latency_ms=20, hang_s=6)))
    backend = judge_backend(judge.url, rpm=600_000, max_concurrent=64, concurrency=2, calls=16,
                            timeout_s=60)
    backend["retry"]["hedge"] = False
    config_path = write_config(tmp_path, {"j": backend}, redis_url=redis_url)
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    (worker,) = start_workers(config_path, [("j", "nohedge@test")])
    stack.callback(worker.kill)
    assert all(o.status == "ok" for o in qreward_queue.submit_batch(
        samples_for(16, "warm"), route="j", app=app).outcomes())
    samples = samples_for(4, "one")
    samples[1]["response"] += " [[mock:hang-once]]"
    # When it is scored
    outcomes = qreward_queue.submit_batch(samples, route="j", app=app).outcomes()
    # Then the hung call is waited for and made once
    assert [o.status for o in outcomes] == ["ok"] * 4, outcomes
    assert judge.stats()["requests"] == 16 + 4


def test_a_call_backing_off_after_faults_is_no_straggler_and_spends_its_attempts_once(
        tmp_path, redis_url, stack):
    # Given a fast judge that answers one sample's calls with a 500 every time, and a backend
    # of 4 attempts whose backoffs (0.5, 1 and 2 s, no jitter) are waited out in the run
    judge = stack.enter_context(spawn(MockJudgeSettings(latency_ms=20)))
    backend = judge_backend(judge.url, concurrency=1, calls=32)
    backend["retry"].update(attempts=4, backoff_base_s=0.5, backoff_cap_s=2.0, jitter=False)
    config_path = write_config(tmp_path, {"j": backend}, redis_url=redis_url)
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    (worker,) = start_workers(config_path, [("j", "backoff@test")])
    stack.callback(worker.kill)
    samples = [{"prompt": f"faulty question {i}",
                "response": f"answer {i}" + (" [[mock:500]]" if i == 3 else "")}
               for i in range(32)]
    # When they are one chunk (its other calls end at once, far faster than the faulty one's
    # tries, which a straggler check would take for a stuck call)
    outcomes = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=60).outcomes()
    # Then the faulty sample is given up after exactly its 4 attempts, in the chunk's run
    # (not handed off and called again by the task's come-back), and the rest is scored
    faulty = outcomes[3]
    assert faulty.status == "error" and faulty.attempts == 4, faulty
    assert "gave up after 4 attempt(s)" in faulty.error, faulty.error
    assert [o.status for i, o in enumerate(outcomes) if i != 3] == ["ok"] * 31
    assert judge.stats()["requests"] == 31 + 4
    assert worker.log.read_text().count("retry: Retry in") == 0
