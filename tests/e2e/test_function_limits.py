"""Per-sample limits of `function` backends: time, memory, recycling, in prefork and embedded mode.

The prefork tests run a real `qrq worker` against real Redis; the reward functions below are
in tests/rewards_for_tests.py, imported by the worker by path.
"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest
from support import ROOT, Worker, function_backend, pid_alive, toml_tables, wait_for, write_config

import qreward_queue
from qreward_queue.backends import FunctionOptions, make_backend
from qreward_queue.backends.function_runner import STARTUP_GRACE_S, runner
from qreward_queue.config.loader import load_backend
from qreward_queue.config.model import Backend, Pool
from qreward_queue.errors import ConfigError, PermanentError, SampleTimeout


def sample(response: str, **extra) -> dict:
    return {"prompt": "p", "response": response, "extra": extra}


def limited(**pool) -> dict:
    tables = function_backend("tests.rewards_for_tests:misbehave", chunk_size=8, concurrency=2)
    tables["backend"]["timeout_s"] = 2
    tables["backend"]["options"] = {"bonus": 0.5}
    tables["pool"].update(memory_limit_mb=1024, **pool)
    return tables


def tree_cpu_percent(pid: int, interval_s: float = 1.0) -> float:
    """CPU used by process `pid` and all its descendants over `interval_s`, in % of one core."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    for p in procs:
        p.cpu_percent(None)
    time.sleep(interval_s)
    total = 0.0
    for p in procs:
        try:
            total += p.cpu_percent(None)
        except psutil.NoSuchProcess:
            continue
    return total


def test_prefork_worker_times_out_only_the_hung_sample_and_stops_its_cpu(tmp_path, redis_url):
    # Given a prefork worker whose function has a 2 s limit per sample and a 1 GB memory cap
    config = write_config(tmp_path, {"lim": limited()}, redis_url=redis_url, fallback_score=-1.0)
    app = qreward_queue.configure(qreward_queue.load_config(config))
    pid_file = tmp_path / "loop.pid"
    batch_in = [
        sample("ab"),
        sample("loop", pid_file=str(pid_file)),
        sample("abcd"),
        sample("alloc"),
        sample("die"),
        sample("swallow"),
        sample("x"),
        sample("alarm"),
    ]
    with Worker(config, "lim") as worker:
        # When one chunk holds an infinite loop, a 10 GB allocation, a crash and a function
        # that swallows every exception
        outcomes = qreward_queue.submit_batch(batch_in, route="lim", app=app).outcomes(timeout=60)
        # Then only those samples fail, each with its own status and reason
        assert [o.status for o in outcomes] == [
            "ok",
            "timeout",
            "ok",
            "error",
            "error",
            "timeout",
            "ok",
            "ok",
        ], outcomes
        assert [outcomes[i].score for i in (0, 2, 6, 7)] == [2.5, 4.5, 1.5, 7.0]
        assert outcomes[1].score == -1.0 and "over the 2 s limit per sample" in outcomes[1].error
        assert "MemoryError" in outcomes[3].error
        assert "reward process died (exit code 3)" in outcomes[4].error
        # the two timeouts are the per-sample limit's, not the batch deadline's
        assert all("over the 2 s limit per sample" in outcomes[i].error for i in (1, 5)), outcomes
        # and the looping process is gone, nothing of the worker burns CPU, the worker lives
        looper = int(pid_file.read_text())
        wait_for(lambda: not pid_alive(looper), 5, "the looping helper to be killed")
        assert worker.proc.poll() is None
        assert tree_cpu_percent(worker.proc.pid) < 30
        # and the worker still scores
        again = qreward_queue.submit_batch([sample("abc")], route="lim", app=app)
        assert again.get(timeout=30) == [3.5]


def test_embedded_mode_runs_signal_based_code_and_enforces_the_limit(tmp_path):
    # Given embedded mode (worker threads), where signal.alarm raises outside a main thread
    config = write_config(
        tmp_path, {"lim": limited(type="threads")}, routes={}, fallback_score=-1.0
    )
    qreward_queue.configure(qreward_queue.load_config(config))
    # When a chunk holds signal-based code and an infinite loop
    outcomes = qreward_queue.submit_batch(
        [sample("alarm"), sample("loop"), sample("ok")], route="lim"
    ).outcomes(timeout=60)
    # Then the signal-based sample is scored, the loop is a timeout, the rest is scored
    assert [(o.status, o.score) for o in outcomes] == [
        ("ok", 7.0),
        ("timeout", -1.0),
        ("ok", 2.5),
    ], outcomes


def backend(**pool) -> Backend:
    return Backend(name="pids", kind="function", chunk_size=4, timeout_s=10,
                   pool=Pool(type="prefork", **pool),
                   options=FunctionOptions(function="tests.rewards_for_tests:pid_score"))


def test_helpers_are_recycled_after_max_tasks_per_child():
    client = make_backend(backend(max_tasks_per_child=2))
    pids = [client.call([sample("a")] * 4).scores for _ in range(6)]
    firsts = [chunk[0] for chunk in pids]
    assert all(len(set(chunk)) == 1 for chunk in pids)  # one helper per chunk
    assert firsts[0] == firsts[1] != firsts[2] == firsts[3] != firsts[4] == firsts[5]


def test_helpers_are_recycled_above_max_memory_per_child():
    client = make_backend(backend(max_memory_per_child_mb=150, max_tasks_per_child=1000))
    small = client.call([sample("a")]).scores[0]
    assert client.call([sample("a")]).scores[0] == small  # below the threshold: kept
    grown = client.call([sample("a", keep_mb=200)]).scores[0]
    assert grown == small
    assert client.call([sample("a")]).scores[0] != small  # above it: a fresh helper


def test_direct_calls_report_each_failure_and_keep_scoring():
    client = make_backend(
        Backend(name="mis", kind="function", chunk_size=8, timeout_s=1, pool=Pool(type="prefork",
                memory_limit_mb=1024),
                options=FunctionOptions(function="tests.rewards_for_tests:misbehave",
                options={"bonus": 1.0}))
    )
    chunk = [sample("a"), sample("loop"), sample("die"), sample("bb"), sample("c_loop")]
    scores = client.call([*chunk, sample("ccc")]).scores
    assert scores[0] == 2.0 and scores[3] == 3.0 and scores[5] == 4.0
    assert isinstance(scores[1], SampleTimeout) and scores[1].status == "timeout"
    assert isinstance(scores[2], PermanentError) and scores[2].status == "error"
    assert isinstance(scores[4], SampleTimeout)
    # a fresh helper gets a startup grace, yet its first sample still has only its limit
    runner(client.config).stop()
    started = time.monotonic()
    first = client.call([sample("loop"), sample("a")]).scores
    assert isinstance(first[0], SampleTimeout) and first[1] == 2.0
    # deadline promise: the first sample's limit is its own 1 s, not 1 s + the startup grace
    assert time.monotonic() - started < STARTUP_GRACE_S


def test_limit_keys_are_read_and_checked(tmp_path):
    path = tmp_path / "f.toml"
    tables = limited(max_tasks_per_child=50, max_memory_per_child_mb=512)
    path.write_text(toml_tables(tables))
    loaded = load_backend(path)
    assert loaded.timeout_s == 2 and loaded.options.options == {"bonus": 0.5}
    assert (loaded.pool.memory_limit_mb, loaded.pool.max_tasks_per_child) == (1024, 50)
    assert loaded.pool.max_memory_per_child_mb == 512
    tables["pool"]["memory_limit_mb"] = "lots"
    path.write_text(toml_tables(tables))
    with pytest.raises(ConfigError, match=r"pool\.memory_limit_mb: expected an integer >= 0"):
        load_backend(path)


def test_embedded_helpers_do_not_rerun_the_callers_script(tmp_path):
    # Given a trainer script without a __main__ guard, in embedded mode
    config = write_config(tmp_path, {"lim": limited(type="threads")}, routes={})
    script = tmp_path / "train.py"
    script.write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT)!r})  # tests.rewards_for_tests\n"
        "import qreward_queue\n"
        f"qreward_queue.configure({str(config)!r})\n"
        "print('SCRIPT-RAN', flush=True)\n"
        "batch = qreward_queue.submit_batch([{'prompt': 'p', 'response': 'abc'}], route='lim')\n"
        "print('SCORES', batch.get(timeout=60), batch.outcomes(), flush=True)\n"
        "qreward_queue.trainer.runtime.shutdown()\n"
    )
    # When it scores through a function backend (helpers start in fresh interpreters)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    # Then the script ran once, and the sample was scored
    assert out.stdout.count("SCRIPT-RAN") == 1, out.stdout + out.stderr
    assert "SCORES [3.5]" in out.stdout, out.stdout + out.stderr


def _recurse(depth: int) -> int:
    return _recurse(depth - 1) + 1 if depth else 0


def _oscillate(times: int) -> None:
    """Recurse 300 frames deep and back, `times` times: crosses a 16 KB frame-stack chunk."""
    for _ in range(times):
        _recurse(300)


def _minor_faults(func, *args) -> int:
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    func(*args)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_helper_loop_keeps_frame_room_so_deep_recursion_does_not_fault():
    from qreward_queue.backends.function_runner import _with_frame_room

    _oscillate(10)  # warm: imports, caches
    plain = min(_minor_faults(_oscillate, 2000) for _ in range(3))
    roomy = min(_minor_faults(_with_frame_room(_oscillate), 2000) for _ in range(3))
    assert plain >= 2000  # without room: every round trip maps a fresh chunk (CPython 3.11+)
    assert roomy < plain / 20
