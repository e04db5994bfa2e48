"""Escape tests: generated programs trying to get out of the code-execution sandbox.

Each program would pass its test case only if it escaped; contained, it fails or times out.
The same programs then go through a real prefork `qrq worker` scoring code_reward, which must
stay alive and keep scoring.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import psutil
import pytest
from support import Worker, function_backend, write_config

import qreward_queue
from qreward_queue.config.loader import load_backend
from qreward_queue.errors import ConfigError
from qreward_queue.rewards import sandbox
from qreward_queue.rewards.code import code_reward, run_tests

CANARY_KEY = "QRQ_TEST_CANARY_KEY"
MARKER = "qrq-sandbox-escape-marker"


class Listener:
    """A TCP listener on 127.0.0.1 that counts the connections it accepts."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self):
        self.sock.close()


@pytest.fixture
def canaries(tmp_path, monkeypatch):
    secret_file = tmp_path / "canary.txt"
    secret_file.write_text("file-canary-7f3a")
    monkeypatch.setenv(CANARY_KEY, "sk-env-canary-91bd")
    listener = Listener()
    yield {"file": str(secret_file), "port": listener.port, "listener": listener}
    listener.close()


def escapes(c: dict) -> dict[str, tuple[str, str]]:
    """name -> (program, the output it would print only if it escaped)."""
    return {
        "read_canary_file": (f"print(open({c['file']!r}).read())", "file-canary-7f3a"),
        "read_env_key": (
            f"import os\nprint(os.environ.get({CANARY_KEY!r}))",
            "sk-env-canary-91bd",
        ),
        "tcp_to_host": (
            "import socket\n"
            f"socket.create_connection(('127.0.0.1', {c['port']}), timeout=1)\n"
            "print('connected')",
            "connected",
        ),
        "fork_bomb": (
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
            "        pass",
            "survived",
        ),
        "alloc_10gb": ("b = bytearray(10 * 2**30)\nprint(len(b))", str(10 * 2**30)),
        "infinite_loop": ("while True:\n    pass", "done"),
        "write_1gb": (
            "with open('big', 'wb') as f:\n    for _ in range(1024):\n"
            "        f.write(b'x' * 2**20)\nprint('written')",
            "written",
        ),
        "kill_parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", "killed"),
        "outlive_the_run": (
            "import subprocess, sys\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)  # {MARKER}'],"
            " start_new_session=True)\nprint('left running')",
            "still running after the run",
        ),
        "print_100mb": ("import sys\nsys.stdout.write('x' * 100_000_000)", "x" * 10),
    }


def marker_processes() -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if any(MARKER in part for part in p.info["cmdline"] or ()):
            found.append(p)
    return found


def sample(program: str, output: str) -> dict:
    return {
        "prompt": "",
        "response": program,
        "extra": {"tests": [{"input": "", "output": output}]},
    }


def test_a_sandbox_is_available_here():
    assert sandbox.pick_mechanism() in ("bwrap", "unshare"), [
        sandbox.probe(m) for m in sandbox.MECHANISMS
    ]


def test_every_escape_is_contained_and_reported(canaries):
    limits = sandbox.Limits(time_s=10, case_s=2)
    statuses = {}
    for name, (program, escaped) in escapes(canaries).items():
        started = time.monotonic()
        score, run, _ = run_tests(sample(program, escaped), limits)
        elapsed = time.monotonic() - started
        statuses[name] = run.cases[0]["status"]
        assert score == 0.0, (name, run)
        # deadline promise: case_s of CPU time, at most case_wall_s of wall clock
        assert elapsed < sandbox.case_wall_s(limits.case_s) + 3, (name, elapsed)
    assert canaries["listener"].accepted == 0
    assert statuses["infinite_loop"] == "timeout"
    assert statuses["print_100mb"] == "output_limit"
    assert statuses["fork_bomb"] == "timeout"  # it keeps trying; RLIMIT_NPROC keeps it small
    assert statuses["alloc_10gb"] == "error"
    assert statuses["write_1gb"] == "error"  # SIGXFSZ at the file-size limit
    assert statuses["kill_parent"] != "timeout"  # it cannot see the harness: no parent to kill
    assert not marker_processes()


def test_a_good_program_passes_and_case_outcomes_are_kept():
    tests = {
        "inputs": ["1 2\n", "5 5\n", "0 0\n"],
        "outputs": ["3\n", "10\n", "1\n"],  # the last one is wrong on purpose
    }
    program = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    score, run, _ = run_tests({"prompt": "", "response": program, "extra": {"tests": tests}})
    assert score == pytest.approx(2 / 3)
    assert [c["stdout"] for c in run.cases] == ["3\n", "10\n", "0\n"]


def test_call_based_cases_leetcode_and_taco_shapes():
    leet = "class Solution:\n    def twoSum(self, nums, target):\n" + (
        "        seen = {}\n        for i, n in enumerate(nums):\n"
        "            if target - n in seen:\n                return [seen[target - n], i]\n"
        "            seen[n] = i\n"
    )
    tests = {
        "fn_name": "twoSum",
        "inputs": [[[2, 7, 11, 15], 9], [[3, 2, 4], 6]],
        "outputs": [[[0, 1]], [1, 2]],
    }
    assert code_reward({"prompt": "", "response": leet, "reference": json.dumps(tests)}) == 1.0
    hanging = "def f(x):\n    while True:\n        pass"
    cases = [
        {"fn_name": "f", "args": [1], "expected": 1},
        {"fn_name": "f", "args": [2], "expected": 2},
    ]
    score, run, _ = run_tests(
        {"prompt": "", "response": hanging, "extra": {"tests": cases}}, sandbox.Limits(case_s=1)
    )
    assert score == 0.0
    assert [c["status"] for c in run.cases] == ["timeout", "skipped"]
    scored = code_reward({"prompt": "", "response": hanging, "extra": {"tests": cases}}, case_s=1)
    assert scored == 0.0 and "case 0: timeout" in scored.detail


def test_no_sandbox_is_a_clear_refusal_unless_unsafe(monkeypatch):
    monkeypatch.setattr(sandbox, "probe", lambda m: f"{m} is not installed")
    with pytest.raises(sandbox.SandboxUnavailable, match="bwrap is not installed; unshare is"):
        sandbox.pick_mechanism()
    assert sandbox.pick_mechanism(unsafe=True) == "unsafe"
    run = sandbox.run_cases("print(input()[::-1])", [{"input": "abc"}], mechanism="unsafe")
    assert run.cases[0]["stdout"] == "cba\n"


def test_escapes_through_a_real_worker_leave_it_alive_and_scoring(canaries, tmp_path, redis_url):
    # Given a prefork worker scoring code_reward (25 s per sample, far above the 2 s per case)
    tables = function_backend("qreward_queue.rewards.code:code_reward", chunk_size=4)
    tables["backend"]["timeout_s"] = 25  # above time_s + case_s + the sandbox's grace
    tables["backend"]["options"] = {"time_s": 6, "case_s": 2}
    config = write_config(tmp_path, {"code": tables}, redis_url=redis_url)
    app = qreward_queue.configure(qreward_queue.load_config(config))
    programs = escapes(canaries)
    batch_in = [sample(p, out) for p, out in programs.values()]
    batch_in.append(
        sample("print(int(input()) + 1)", "8")
        | {"extra": {"tests": [{"input": "7", "output": "8"}]}}
    )
    with Worker(config, "code") as worker:
        # When every escape attempt is scored through the queue
        outcomes = qreward_queue.submit_batch(batch_in, route="code", app=app).outcomes(timeout=120)
        # Then each one is contained and scores 0 (a hang is a failed case, not unscored),
        # the honest program scores 1, and the worker lives on
        want = [("ok", 0.0) for _ in programs]
        assert [(o.status, o.score) for o in outcomes] == [*want, ("ok", 1.0)], outcomes
        assert "case 0: timeout" in outcomes[5].detail
        assert worker.proc.poll() is None
        again = qreward_queue.submit_batch([batch_in[-1]], route="code", app=app)
        assert again.get(timeout=60) == [1.0]
    assert canaries["listener"].accepted == 0
    assert not marker_processes()
    assert not os.path.exists(os.path.join(str(tmp_path), "big"))


def test_a_backend_timeout_below_the_sandboxs_own_bound_is_refused_when_it_loads(tmp_path):
    # Given the shipped example, and the same file with the sample timeout it had (20 s)
    example = Path(qreward_queue.__file__).parents[1] / "examples" / "workers" / "code.toml"
    assert load_backend(example).timeout_s >= 26
    short = tmp_path / "code.toml"
    short.write_text(example.read_text().replace("timeout_s = 30", "timeout_s = 20"))
    # Then loading it says, in one line, which limit is too low and what it must cover
    with pytest.raises(ConfigError) as refused:
        load_backend(short)
    message = str(refused.value)
    assert "\n" not in message and "timeout_s" in message and "at least 26 s" in message
    assert "time_s 10 + a last case's wall clock 5" in message
