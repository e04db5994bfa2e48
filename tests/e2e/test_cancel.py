"""Cancellation: no judge call is made for samples nobody waits for any more.

Real Redis, a real `qrq worker`, the mock judge over HTTP; its own request counter is the truth
of what was bought. A call in flight when the cancel reaches the worker still ends (the judge
has counted it already); none starts after that.

No test races its batch: the judge answers a few calls, then holds every reply (`hold`) until
the test has cancelled (or interrupted) and releases it, so however loaded the machine, the
batch is surely unfinished when the cancel comes.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time

import pytest
from support import ROOT, expected, judge_backend, start_workers, wait_for, write_config

import qreward_queue
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn
from qreward_queue.trainer.batcher import MicroBatcher

CALLS = 8  # calls in flight per worker: the most a cancel can leave running


def samples_for(n: int, tag: str) -> list[dict]:
    return [{"prompt": f"{tag} question {i}", "response": f"answer {i}"} for i in range(n)]


@pytest.fixture
def slow_stack(tmp_path, redis_url, stack):
    """A judge at ~300 ms a call and one worker making 8 calls at once (~25 samples/s)."""
    judge = stack.enter_context(spawn(MockJudgeSettings(latency_ms=300, latency_cv=0.1)))
    config_path = write_config(
        tmp_path, {"j": judge_backend(judge.url, concurrency=2, calls=CALLS)}, redis_url=redis_url
    )
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    (worker,) = start_workers(config_path, [("j", "cancel@test")])
    stack.callback(worker.kill)
    return app, judge, config_path


def requests(judge) -> int:
    return judge.stats()["requests"]


def answered(judge, n: int) -> None:
    """Wait until the judge (held after `n` answers) has answered them."""
    wait_for(lambda: judge.stats()["accepted"] >= n, 60, f"the judge's first {n} answers")


def holding(judge, answers: int):
    """The judge answers `answers` calls, then holds the rest until released (see calls_stop)."""
    judge.release()
    judge.reset()
    judge.hold(answers)


def calls_stop(judge, settle_s: float = 1.5, watch_s: float = 2.0) -> int:
    """The judge's request count once the cancel has reached the worker (`settle_s`: the ~1 s
    the issue allows plus the calls in flight ending); it must not grow for `watch_s` more.
    A held judge is released first: the calls it held end, and no new one may start."""
    judge.release()
    time.sleep(settle_s)
    settled = requests(judge)
    time.sleep(watch_s)
    assert requests(judge) == settled, "calls went on after the cancel"
    return settled


def check_cancelled(app, samples, outcomes, calls: int) -> None:
    """ok (and right) or cancelled, nothing else; calls beyond the scored ones are at most
    the ones in flight at the cancel and those started before the worker saw it (it looks
    every 0.25 s: ~6 more at ~25 calls/s)."""
    assert len(outcomes) == len(samples) and None not in outcomes
    by_status = {o.status for o in outcomes}
    assert by_status == {"ok", "cancelled"}, by_status
    for sample, outcome in zip(samples, outcomes, strict=True):
        if outcome.status == "ok":
            assert outcome.score == expected(app, "j", sample)
        else:
            assert outcome.score == 0.0 and "cancelled" in outcome.error, outcome
    ok = sum(o.status == "ok" for o in outcomes)
    assert ok <= calls <= ok + 2 * CALLS, (ok, calls)


def test_cancel_stops_the_calls_and_keeps_what_was_scored(slow_stack):
    app, judge, _ = slow_stack
    samples = samples_for(300, "cancel")
    holding(judge, 30)
    batch = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=120)
    answered(judge, 30)
    cancelled = batch.cancel()
    outcomes = batch.outcomes()  # at once: nothing is pending any more
    assert cancelled == sum(o.status == "cancelled" for o in outcomes) > 150
    check_cancelled(app, samples, outcomes, calls_stop(judge))
    assert batch.cancel() == 0  # cancelling twice changes nothing


def test_an_interrupted_wait_or_a_failing_with_block_cancels(slow_stack):
    app, judge, _ = slow_stack
    # Given a batch whose get() is interrupted by Ctrl-C once the judge has answered some
    samples = samples_for(200, "interrupt")
    holding(judge, 20)
    batch = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=120)
    main = threading.main_thread().ident
    assert main is not None
    # a real SIGINT at the main thread, as Ctrl-C sends: it interrupts a wait in progress
    threading.Thread(target=lambda: (answered(judge, 20),
                                     signal.pthread_kill(main, signal.SIGINT)),
                     daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        batch.get()
    check_cancelled(app, samples, batch.partial(), calls_stop(judge))
    # And a trainer step that raises inside `with submit_batch(...)`
    holding(judge, 20)
    more = samples_for(200, "raises")
    batch = qreward_queue.submit_batch(more, route="j", app=app, deadline_s=120)
    with pytest.raises(RuntimeError, match="trainer bug"), batch:
        answered(judge, 20)
        raise RuntimeError("trainer bug")
    check_cancelled(app, more, batch.partial(), calls_stop(judge))


def test_cancelled_awaiters_cancel_the_batch_but_the_micro_batcher_keeps_the_rest(slow_stack):
    app, judge, _ = slow_stack
    # Given an awaited batch whose only awaiter is cancelled
    samples = samples_for(200, "await")
    holding(judge, 20)
    batch = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=120)

    async def await_then_cancel() -> None:
        with pytest.raises(TimeoutError):  # a waiter that timed out cancels nothing...
            await batch.outcomes_async(timeout=0.2)
        waiter = asyncio.ensure_future(batch.outcomes_async())
        await asyncio.to_thread(answered, judge, 20)  # ...the batch goes on
        assert None in batch.partial()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter

    asyncio.run(await_then_cancel())
    wait_for(lambda: None not in batch.partial(), 5, "the poller to cancel the batch")
    check_cancelled(app, samples, batch.partial(), calls_stop(judge))
    # When callers of one micro-batch give up, except one
    holding(judge, 10)
    batcher = MicroBatcher(max_items=100, max_wait_ms=50)
    shared = samples_for(60, "shared")
    futures = [batcher.submit(s, route="j") for s in shared]
    answered(judge, 10)
    left = futures[-1]  # the last sample: not scored yet (the judge holds its replies)
    gave_up = [f for f in futures[:-1] if f.cancel()]  # those served already cannot give up
    assert gave_up and not left.done()
    judge.release()
    # Then the one left gets its score: the batch went on for it
    assert left.result(timeout=60).score == expected(app, "j", shared[-1])
    # And when all of another micro-batch's callers give up, its calls stop
    holding(judge, 10)
    gone = [batcher.submit(s, route="j") for s in samples_for(200, "gone")]
    answered(judge, 10)
    gave_up = [f for f in gone if f.cancel()]  # every caller not yet served gives up
    assert len(gave_up) > 150 and all(f.done() for f in gone)
    assert calls_stop(judge) < 10 + 2 * CALLS + 10  # started + in flight, not the 200


def test_qrq_score_on_ctrl_c_writes_every_outcome_and_exits_130(slow_stack, tmp_path):
    app, judge, config_path = slow_stack
    samples = samples_for(300, "cli")
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(s) + "\n" for s in samples))
    holding(judge, 30)
    proc = subprocess.Popen(
        [sys.executable, "-m", "qreward_queue.cli", "score", str(source), "-o", str(out),
         "--route", "j", "--config", str(config_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    answered(judge, 30)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in lines] == list(range(len(samples)))
    outcomes = [qreward_queue.Outcome.from_dict(r) for r in lines]
    check_cancelled(app, samples, outcomes, calls_stop(judge))
    cancelled = sum(o.status == "cancelled" for o in outcomes)
    assert f"{cancelled} cancelled" in stderr.splitlines()[-1], stderr
    assert "Aborted" not in stderr
