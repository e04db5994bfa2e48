"""Fair shares between jobs: the gate's script (real Redis), the `[jobs]` configuration, and
jobs from separate processes sharing one rate-limited mock judge through real workers."""

from __future__ import annotations

import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

import pytest
from support import ROOT, Worker, judge_backend, wait_for, write_config

import qreward_queue
from qreward_queue import keys
from qreward_queue.config.loader import load_config
from qreward_queue.config.model import Route
from qreward_queue.errors import ConfigError, JobBudgetExceeded
from qreward_queue.ops import exporter
from qreward_queue.ops.job_spend import job_rows
from qreward_queue.ops.status import render_status
from qreward_queue.planning import capacity
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn
from qreward_queue.trainer import shares

# -- the script ------------------------------------------------------------------------------

LEVEL_KEYS = keys.share_keys("qrq.j", 6)
IDLE_MS, STALE_MS = 60_000, 600_000


@pytest.fixture
def share(redis_client):
    script = redis_client.register_script(
        (resources.files("qreward_queue.flow") / "lua" / "share.lua").read_text())

    def ask(job: str, weight: float, depth: float, sizes: list[int], idle_ms: int = IDLE_MS,
            stale_ms: int = STALE_MS) -> int:
        return int(script(keys=[LEVEL_KEYS["active"], LEVEL_KEYS["queued"],
                                LEVEL_KEYS["weights"]],
                          args=[job, weight, idle_ms, stale_ms, depth, 3600, *sizes]))

    return ask


def waiting(redis_client, job: str) -> int:
    return int(redis_client.hget(LEVEL_KEYS["queued"], job) or 0)


def test_a_job_alone_is_granted_the_whole_depth_and_books_it(share, redis_client):
    assert share("a", 1, 50, [10] * 8) == 5  # 0..40 waiting + half a chunk stays within 50
    assert waiting(redis_client, "a") == 50
    assert share("a", 1, 50, [10] * 8) == 0  # booked: another process of the job gets nothing


def test_active_jobs_split_the_depth_by_weight(share, redis_client):
    share("a", 1, 60, [10])
    share("b", 2, 60, [10])
    redis_client.hset(LEVEL_KEYS["queued"], mapping={"a": 0, "b": 0})  # workers took them
    assert share("a", 1, 60, [5] * 20) == 4  # a third of 60: 20 waiting
    assert share("b", 2, 60, [5] * 20) == 8  # two thirds: 40
    assert (waiting(redis_client, "a"), waiting(redis_client, "b")) == (20, 40)


def test_a_job_with_nothing_waiting_always_moves(share):
    share("big", 10, 20, [1])
    assert share("small", 1, 20, [16, 16]) == 1  # its share (1.8) is smaller than a chunk


def test_idle_jobs_drop_out_unless_they_have_samples_waiting(share, redis_client):
    share("a", 1, 40, [10])
    share("b", 1, 40, [10])
    # b still has 10 waiting: active however long ago it was seen
    redis_client.hset(LEVEL_KEYS["queued"], "a", 0)
    assert share("a", 1, 40, [10] * 4, idle_ms=0) == 2  # half of 40
    # once b's samples were taken it drops out, and a has the whole depth
    redis_client.hset(LEVEL_KEYS["queued"], mapping={"a": 0, "b": 0})
    assert share("a", 1, 40, [10] * 4, idle_ms=0) == 4
    assert redis_client.zrange(LEVEL_KEYS["active"], 0, -1) == [b"a"]


def test_a_job_not_seen_for_long_is_forgotten_whatever_its_count(share, redis_client):
    share("gone", 1, 40, [10])  # its process died with 10 counted
    redis_client.hset(LEVEL_KEYS["queued"], "gone", 10)
    assert share("a", 1, 40, [10] * 4, idle_ms=0, stale_ms=0) == 4
    assert redis_client.hget(LEVEL_KEYS["queued"], "gone") is None


def test_a_count_below_zero_is_read_as_zero(share, redis_client):
    redis_client.hset(LEVEL_KEYS["queued"], "a", -30)  # taken off after a lost booking
    assert share("a", 1, 20, [10] * 4) == 2
    assert waiting(redis_client, "a") == 20


# -- configuration ---------------------------------------------------------------------------


def config_with(tmp_path: Path, text: str):
    path = write_config(tmp_path, {"j": judge_backend("http://127.0.0.1:9")})
    path.write_text(path.read_text() + text)
    return load_config(path)


def test_jobs_are_configured_with_weights_budgets_and_labels(tmp_path):
    config = config_with(tmp_path, "[jobs]\nname = 'lab-a'\nmax_labels = 3\n"
                                   "[jobs.big]\nweight = 2\n[jobs.big.budget]\ntokens_total = 9\n"
                                   "[gateway.budget.gw]\ncost_total = 1.5\n")
    jobs = config.jobs
    assert (jobs.name, jobs.max_labels, jobs.fair_shares) == ("lab-a", 3, True)
    assert (jobs.weight("big"), jobs.weight("unnamed")) == (2.0, 1.0)
    assert jobs.budget("big").tokens_total == 9  # type: ignore[union-attr]
    assert jobs.budget("gw").cost_total == 1.5  # type: ignore[union-attr]  # the older spelling
    assert jobs.budget("unnamed") is None


@pytest.mark.parametrize(("text", "named"), [
    ("[jobs.'two words']\nweight = 1\n", "jobs.two words: expected a job's name: 1 to 64"),
    ("[jobs.a]\nweight = -1\n", "jobs.a.weight: expected a positive number"),
    ("[jobs.a]\nwieght = 2\n", "wieght"),
    ("[jobs]\nfair_shares = 'no'\n", "jobs.fair_shares: expected true or false"),
    ("[jobs.a.budget]\ntokens_total = 5\n[gateway.budget.a]\ntokens_total = 5\n",
     "also set as [gateway.budget.a]"),
])
def test_a_wrong_jobs_table_is_named(tmp_path, text, named):
    with pytest.raises(ConfigError) as raised:
        config_with(tmp_path, text)
    assert named in str(raised.value)


def test_the_job_comes_from_the_call_then_the_environment_then_the_config(tmp_path,
                                                                         monkeypatch):
    app = qreward_queue.configure(config_with(tmp_path, "[jobs]\nname = 'cfg'\n"))
    monkeypatch.delenv("QRQ_JOB", raising=False)
    assert shares.job_of(app, None) == "cfg"
    monkeypatch.setenv("QRQ_JOB", "env-job")
    assert (shares.job_of(app, None), shares.job_of(app, "arg")) == ("env-job", "arg")
    monkeypatch.setenv("QRQ_JOB", "bad job")
    with pytest.raises(ValueError, match=r"^QRQ_JOB: expected a job's name: 1 to 64"):
        shares.job_of(app, None)


# -- jobs from separate processes, real workers, a rate-limited judge ------------------------

RPM = 600  # 10 calls a second: chunks of 3 samples, a depth of 10
JOB_SCRIPT = """
import sys, time
import qreward_queue
job, n, priority, out, config = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
app = qreward_queue.configure(config)
samples = [{"prompt": f"{job} {priority} {i}", "response": str(i)} for i in range(n)]
with open(out, "a", buffering=1) as fh:
    batch = qreward_queue.submit_batch(samples, app=app, job=job, priority=priority,
                                       deadline_s=120)
    batch.on_outcome(lambda i, o: fh.write(f"{time.time()} {o.status}\\n"))
    batch.outcomes()
"""


class Job:
    """A trainer process submitting one batch of `n` samples as `job`; the time and status of
    each outcome as it came are in `out`."""

    def __init__(self, tmp_path: Path, config: Path, job: str, n: int,
                 priority: str = "train"):
        self.out = tmp_path / f"{job}-{priority}.times"
        self.out.touch()
        self.proc = subprocess.Popen([sys.executable, "-c", JOB_SCRIPT, job, str(n), priority,
                                      str(self.out), str(config)], cwd=ROOT)

    def times(self) -> list[float]:
        return [float(line.split()[0]) for line in self.out.read_text().splitlines()]

    def statuses(self) -> list[str]:
        return [line.split()[1] for line in self.out.read_text().splitlines()]

    def finish(self) -> None:
        assert self.proc.wait(180) == 0

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


@pytest.fixture
def shared_judge(tmp_path, redis_url, stack):
    judge = stack.enter_context(spawn(MockJudgeSettings(rpm=RPM, max_concurrent=16,
                                                        latency_ms=50)))
    config = write_config(tmp_path, {"j": judge_backend(judge.url, rpm=RPM, max_concurrent=16,
                                                        concurrency=2, calls=4)},
                          redis_url=redis_url, route="j")
    config.write_text(config.read_text() + "[jobs]\nmax_labels = 1\n"
                      "[jobs.small]\nweight = 3\n")
    stack.enter_context(Worker(config, "j"))
    return config


def in_window(times: list[float], start: float, end: float) -> int:
    return sum(start <= t <= end for t in times)


def test_a_late_job_gets_its_weighted_share_at_once(tmp_path, shared_judge):
    # Given job big (weight 1) with 40 s of work queued first, and job small (weight 3)
    # joining later from another process
    config = shared_judge
    big = Job(tmp_path, config, "big", 400)
    try:
        wait_for(lambda: len(big.times()) >= 20, 60, "big's first outcomes")
        small = Job(tmp_path, config, "small", 90)
        small.finish()
    finally:
        big.stop()
    # Then small had its share while both had work (from its second outcome on): 3 calls of
    # every 4, where before fair shares it waited for big's whole backlog (40 s)
    mine, theirs = small.times(), big.times()
    assert small.statuses() == ["ok"] * 90
    start, end = mine[1], mine[-1]
    share = in_window(mine, start, end) / (in_window(mine, start, end)
                                           + in_window(theirs, start, end))
    assert 0.6 <= share <= 0.9, (share, in_window(theirs, start, end))
    # and the workers booked each job's spend, which status and Prometheus show per job
    app = qreward_queue.configure(str(config))

    def spent() -> dict[str, dict] | None:  # a worker writes its calls' spend within 0.1 s
        rows = {r["job"]: r for r in job_rows(app.store, app.qrq_config)}
        done = rows["small"]["total"]["calls"] >= 90 and rows["big"]["total"]["calls"] >= len(
            theirs)
        return rows if done else None

    rows = wait_for(spent, 10, "each job's spend")
    assert rows["small"]["weight"] == 3.0
    assert f"job small: spent {rows['small']['total']['calls']} calls" in render_status(
        app.qrq_config)
    # beyond max_labels = 1 (the configured job first) the rest is `other`
    families = {f.name: f for f in exporter.RedisStateCollector(app).collect()}
    labelled = {s.labels["job"]: s.value for s in families["qrq_job_calls"].samples}
    assert set(labelled) == {"small", "other"}
    assert labelled["small"] == rows["small"]["total"]["calls"]
    assert labelled["other"] >= rows["big"]["total"]["calls"]  # big's last calls may go on


def test_a_small_jobs_val_overtakes_every_jobs_train_work(tmp_path, shared_judge):
    # Given job big's train backlog of 40 s
    config = shared_judge
    big = Job(tmp_path, config, "big", 400)
    try:
        wait_for(lambda: len(big.times()) >= 20, 60, "big's first outcomes")
        # When job small submits a val batch
        val = Job(tmp_path, config, "small", 30, priority="val")
        val.finish()
        done_at = val.times()[-1]
    finally:
        big.stop()
    # Then it finished while most of big's train work was still waiting
    assert val.statuses() == ["ok"] * 30
    assert len([t for t in big.times() if t <= done_at]) < 200


def test_held_chunks_are_dropped_by_a_cancel_and_time_out_at_the_deadline(tmp_path, redis_url):
    # Given no worker: a job's share of the queue (a depth of 10 at 600 rpm) fills at once
    config = write_config(tmp_path, {name: judge_backend("http://127.0.0.1:9", rpm=RPM)
                                     for name in ("j", "k")}, redis_url=redis_url, route="j")
    app = qreward_queue.configure(str(config))
    samples = [{"prompt": f"p{i}", "response": "r"} for i in range(60)]
    batch = qreward_queue.submit_batch(samples, app=app, job="solo")
    queue = keys.share_keys(app.qrq_config.backend("j").queue, 6)["queued"]
    published = int(app.store.hget(queue, "solo"))
    assert 0 < published < 60  # the rest is held in this process
    gate = shares.gate(app)
    assert gate is not None and gate.held_samples("j") == 60 - published
    # what it holds is queued work to the planner: a route over j and an idle sibling would
    # send new samples to the sibling
    assert capacity.route_shares(app, Route("r", ("j", "k"), (1.0, 1.0)), 60,
                                 gate.held_samples) == [0.0, 60.0]
    # When it is cancelled, the held chunks are never published and come back cancelled
    assert batch.cancel() == 60
    assert gate.held() == 0
    assert [o.status for o in batch.outcomes()] == ["cancelled"] * 60
    assert int(app.store.hget(queue, "solo")) == published
    # and a batch held past its deadline comes back `timeout`, nothing sent again
    late = qreward_queue.submit_batch(samples[:30], app=app, job="solo", deadline_s=1.5)
    statuses = {o.status for o in late.outcomes()}
    assert statuses == {"timeout"} and late.resubmitted == 0
    assert gate.held() == 0


def test_the_gate_waits_in_redis_for_a_worker_to_start_a_task(tmp_path, redis_url,
                                                              monkeypatch):
    monkeypatch.setattr(shares, "RECHECK_S", 30.0)  # only a worker's announcement wakes it
    # Given no worker: a job's share of the queue fills at once and the rest is held
    config = write_config(tmp_path, {"j": judge_backend("http://127.0.0.1:9", rpm=RPM)},
                          redis_url=redis_url, route="j")
    app = qreward_queue.configure(str(config))
    gate = shares.gate(app)
    assert gate is not None
    checks: list[float] = []
    check = gate._check
    monkeypatch.setattr(gate, "_check", lambda *a: (checks.append(time.monotonic()), check(*a)))
    batch = qreward_queue.submit_batch([{"prompt": f"p{i}", "response": "r"} for i in range(60)],
                                       app=app, job="solo")
    queue = app.qrq_config.backend("j").queue
    published = int(app.store.hget(keys.share_keys(queue, 6)["queued"], "solo"))
    held = gate.held_samples("j")
    assert held == 60 - published > 0
    # When nothing drains for a second, the gate does not look again (the submit's check,
    # and the gate thread's first two as it subscribes; a 50 ms timer made 20 more)
    time.sleep(1.0)
    assert len(checks) <= 3, checks
    # and when a worker starts a task of the job's, the gate publishes more at once
    capacity.QueuedSamples.of(app).add({queue: -published}, "solo", 6)
    wait_for(lambda: gate.held_samples("j") < held, 5, "the gate to publish on the news")
    batch.cancel()


def test_a_job_at_its_budget_queues_nothing(tmp_path, redis_url):
    config = write_config(tmp_path, {"j": judge_backend("http://127.0.0.1:9")},
                          redis_url=redis_url, route="j")
    config.write_text(config.read_text() + "[jobs.capped.budget]\ntokens_total = 100\n")
    app = qreward_queue.configure(str(config))
    app.store.hset(keys.job_spend("capped"), mapping={"tokens_in": 90, "tokens_out": 10})
    with pytest.raises(JobBudgetExceeded, match=r"budget tokens_total = 100 of job 'capped'"):
        qreward_queue.submit_batch([{"prompt": "p", "response": "r"}], app=app, job="capped")
    assert app.store.hlen(keys.share_keys(app.qrq_config.backend("j").queue, 6)["queued"]) == 0


def test_a_backend_without_an_rpm_limit_gets_every_chunk_at_submit(tmp_path, redis_url):
    # its rate is unknown (a concurrency is not a rate): there is no depth to share
    config = write_config(tmp_path, {"j": judge_backend("http://127.0.0.1:9", rpm=0)},
                          redis_url=redis_url, route="j")
    app = qreward_queue.configure(str(config))
    batch = qreward_queue.submit_batch([{"prompt": f"p{i}", "response": "r"} for i in range(200)],
                                       app=app, job="solo")
    assert capacity.queue_depth(app.store, app.qrq_config.backend("j").queue) > 2
    assert capacity.QueuedSamples(app.store).read("qrq.j") == 200
    batch.cancel()
