"""The front door as a newcomer meets it: the installed package runs its own demo, a batch with
no worker says so, Redis problems and unset keys are one line, exit codes tell the truth."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import click
import pytest
import redis
import yaml
from support import ROOT, Worker, free_port, judge_backend, wait_for, write_config

import qreward_queue
from qreward_queue.backends import JudgeOptions
from qreward_queue.backends.transport import post_json
from qreward_queue.broker.app import QrqCelery
from qreward_queue.config.loader import load_backend, load_config
from qreward_queue.config.model import PACKAGED_CONFIG, Backend, Limits, advised_calls
from qreward_queue.errors import TransientError
from qreward_queue.keys import queue_lists
from qreward_queue.priority import Priority
from qreward_queue.testing.mock_judge import MockJudge, MockJudgeSettings


def qrq(*args: str, cwd: Path, env: dict | None = None, timeout: float = 120):
    """`python -m qreward_queue.cli ARGS` with no QRQ_* variables but those in `env`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("QRQ_")}
    return subprocess.run(
        [sys.executable, "-m", "qreward_queue.cli", *args],
        env={**base, **(env or {})}, cwd=cwd, capture_output=True, text=True, timeout=timeout,
    )


def error_line(stderr: str) -> str:
    """stderr must be exactly one `qrq: error: ...` line: no traceback, nothing else."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qrq: error: "), stderr
    return lines[0]


def test_packaged_defaults_are_the_repository_files():
    packaged = PACKAGED_CONFIG.parent
    assert (packaged / "qrq.toml").read_text() == (ROOT / "qrq.toml").read_text()
    shipped = sorted(p.name for p in (packaged / "workers").glob("*.toml"))
    assert shipped == sorted(p.name for p in (ROOT / "workers").glob("*.toml"))
    for name in shipped:
        assert (packaged / "workers" / name).read_text() == (ROOT / "workers" / name).read_text()


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> Path:
    """A fresh virtualenv holding the wheel and no extra (built once for this module)."""
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = tmp.glob("qreward_queue-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run([venv / "bin" / "pip", "install", "-q", str(wheel)], check=True,
                   capture_output=True, timeout=400)
    return venv


def outside_env() -> dict:
    """The environment without QRQ_* and PYTHON* variables (no path into the repository)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("QRQ_", "PYTHON"))}


@pytest.mark.timeout(600)
def test_wheel_in_a_fresh_virtualenv_runs_the_demo_from_any_directory(tmp_path, wheel_venv):
    venv = wheel_venv
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = outside_env()
    run = subprocess.run([venv / "bin" / "qrq", "demo", "--prompts", "8"], cwd=elsewhere,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout.splitlines()
    assert out[0].startswith("qrq: embedded mode")
    assert "example shipped with qrq" in out[1] and str(venv) in out[1]  # not the repo's file
    assert [line.split()[0] for line in out if line.split()[0] in ("naive", "asyncio", "qrq")] \
        == ["naive", "asyncio", "qrq"]
    assert "every score matches the judge's rule" in out[-1]
    # the summary leads with what each client made the judges refuse
    assert re.match(r"qrq: \d+ requests refused by the judges \(429\), the asyncio client \d+, "
                    r"the naive loop \d+; ", out[-1]), out[-1]
    version = subprocess.run([venv / "bin" / "qrq", "--version"], capture_output=True,
                             text=True, timeout=60, cwd=elsewhere)
    assert version.stdout.strip() == "qrq, version 0.1.0"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("command, module, extra", [
    (["bin/qrq", "gateway", "--port", "0"], "aiohttp", "gateway"),
    (["bin/python", "examples/verl_reward.py"], "numpy", "examples"),
    (["bin/python", "examples/openrlhf_gateway.py"], "aiohttp", "gateway"),
])
def test_a_missing_extra_is_one_line_naming_it(wheel_venv, command, module, extra):
    # The wheel alone has neither aiohttp nor numpy; the examples run from the repository
    exe, *args = command
    run = subprocess.run([wheel_venv / exe, *args], cwd=ROOT, env=outside_env(),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode in (1, 2), run.stderr
    line = error_line(run.stderr)
    assert f"{module} is not installed: pip install 'qreward-queue[{extra}]'" in line
    assert (f"examples/{Path(args[0]).name}" if "examples" in args[0] else "qrq gateway") in line


def test_score_without_a_config_says_where_it_looked(tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n")
    result = qrq("score", "in.jsonl", cwd=tmp_path)
    assert result.returncode == 2
    line = error_line(result.stderr)
    assert str(tmp_path / "qrq.toml") in line and "QRQ_CONFIG" in line and "--config" in line


@pytest.mark.parametrize("command", ["status", "score"])
def test_redis_on_a_closed_port_is_one_line_without_the_password(tmp_path, command):
    config = write_config(tmp_path, {"j": judge_backend("http://127.0.0.1:9")},
                          routes={"r": ["j"]})
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n")
    url = f"redis://:s3cret-pw@127.0.0.1:{free_port()}/0"
    args = [command] if command == "status" else [command, "in.jsonl", "--route", "r"]
    result = qrq(*args, cwd=tmp_path, env={"QRQ_CONFIG": str(config), "QRQ_REDIS_URL": url})
    assert result.returncode == 2
    line = error_line(result.stderr)
    assert "cannot reach Redis at redis://127.0.0.1:" in line and "QRQ_REDIS_URL" in line
    assert "s3cret-pw" not in result.stderr + result.stdout


@pytest.mark.parametrize("events", [[], ["-E"]])  # Celery's banner says "enable -E"
def test_worker_with_redis_unreachable_fails_at_start_in_one_line(tmp_path, events):
    config = write_config(tmp_path, {"j": judge_backend("http://127.0.0.1:9")})
    url = f"redis://:s3cret-pw@127.0.0.1:{free_port()}/0"
    result = qrq("worker", str(tmp_path / "workers" / "j.toml"), *events, cwd=tmp_path,
                 env={"QRQ_CONFIG": str(config), "QRQ_REDIS_URL": url}, timeout=60)
    assert result.returncode == 2
    line = error_line(result.stderr)
    assert "cannot reach Redis at redis://127.0.0.1:" in line and "s3cret-pw" not in line
    assert "celery@" not in result.stdout  # no banner: it never started


def test_a_worker_is_not_stopped_by_a_typo_in_another_backend_file(tmp_path):
    # Given a route over a and b, and a typo in a's file
    config = write_config(tmp_path, {n: judge_backend("http://127.0.0.1:9") for n in "ab"},
                          routes={"r": ["a", "b"]})
    broken = tmp_path / "workers" / "a.toml"
    broken.write_text(broken.read_text().replace("rpm = 0", "rpm = 'fast'"))
    # When b's worker starts (against a closed Redis port, so it stops right after the checks)
    url = f"redis://127.0.0.1:{free_port()}/0"
    result = qrq("worker", str(tmp_path / "workers" / "b.toml"), cwd=tmp_path,
                 env={"QRQ_CONFIG": str(config), "QRQ_REDIS_URL": url}, timeout=60)
    # Then a's problem is a warning and b's worker got as far as Redis
    warning, error = result.stderr.strip().splitlines()
    assert warning == (f"qrq: warning: {broken}: limits.rpm: expected a number, got 'fast' "
                       "(left out of its routes here)")
    assert error.startswith("qrq: error: cannot reach Redis")
    # and b's own problems are errors, all of them in one line
    own = tmp_path / "workers" / "b.toml"
    own.write_text(own.read_text().replace("calls = 32", "calls = 0\ncolor = 1"))
    result = qrq("worker", str(own), cwd=tmp_path,
                 env={"QRQ_CONFIG": str(config), "QRQ_REDIS_URL": url}, timeout=60)
    assert result.returncode == 2
    assert error_line(result.stderr) == (f"qrq: error: {own}: pool.calls: expected an integer "
                                         ">= 1, got 0; pool.color: unknown key (known: calls, "
                                         "concurrency, max_memory_per_child_mb, "
                                         "max_tasks_per_child, memory_limit_mb, rate_limit, type)")


def test_python_api_without_a_config_says_no_config_was_found(tmp_path):
    code = ("import qreward_queue as q\n"
            "try:\n q.submit_batch([{'prompt': 'p', 'response': 'r'}], route='demo')\n"
            "except q.QrqError as e:\n print(e)")
    base = {k: v for k, v in os.environ.items() if not k.startswith("QRQ_")}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=base,
                         capture_output=True, text=True, timeout=60).stdout
    assert "no qrq.toml found" in out and str(tmp_path / "qrq.toml") in out
    assert "qreward_queue.configure(FILE)" in out and "QRQ_CONFIG" in out


def test_every_option_says_what_it_does():
    from qreward_queue.cli.main import cli

    def options(command, path):
        for name, sub in getattr(command, "commands", {}).items():
            yield from options(sub, [*path, name])
        for param in command.params:
            if isinstance(param, click.Option):
                yield " ".join(path), param
    silent = [(cmd, p.opts) for cmd, p in options(cli, ["qrq"]) if not p.help]
    assert silent == []
    score_help = qrq("score", "--help", cwd=ROOT).stdout
    assert '"prompt"' in score_help and '"response"' in score_help


def test_a_batch_that_timed_out_with_no_worker_says_why_in_its_summary(tmp_path, redis_url):
    config = write_config(tmp_path, {"j": judge_backend("http://127.0.0.1:9")},
                          redis_url=redis_url, routes={"r": ["j"]})
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n")
    result = qrq("score", "in.jsonl", "--route", "r", "--deadline-s", "8", "-o", "out.jsonl",
                 cwd=tmp_path, env={"QRQ_CONFIG": str(config)})
    assert result.returncode == 3
    summary = result.stderr.strip().splitlines()[-1]
    assert summary.startswith("scored 1 timeout; 1 of 1 samples not scored")
    assert "no live worker consumes queue qrq.j of backend 'j'" in summary
    assert f"`qrq worker {tmp_path / 'workers' / 'j.toml'}`" in summary


def test_redis_database_out_of_range_is_one_line(tmp_path):
    result = qrq("status", cwd=tmp_path, env={"QRQ_REDIS_URL": "redis://127.0.0.1:6379/999"})
    assert result.returncode == 2
    line = error_line(result.stderr)
    assert "redis://127.0.0.1:6379/999" in line and "databases" in line


def test_score_exit_status_says_whether_samples_were_scored(tmp_path):
    closed = f"http://127.0.0.1:{free_port()}"
    with MockJudge(MockJudgeSettings(latency_ms=1, latency_cv=0)) as judge:
        config = write_config(
            tmp_path,
            {"up": judge_backend(judge.url), "down": judge_backend(closed)},
            routes={"up": ["up"], "down": ["down"]},
        )
        samples = [{"prompt": f"{i}+1?", "response": str(i + 1)} for i in range(3)]
        (tmp_path / "in.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
        env = {"QRQ_CONFIG": str(config)}
        every = qrq("score", "in.jsonl", "--route", "down", cwd=tmp_path, env=env)
        assert every.returncode == 3, every.stderr
        summary = every.stderr.strip().splitlines()[-1]
        assert summary.startswith("scored 3 error; 3 of 3 samples not scored, most often (3x)")
        assert f"connection to {closed}/v1/chat/completions failed" in summary
        fine = qrq("score", "in.jsonl", "--route", "up", cwd=tmp_path, env=env)
        assert fine.returncode == 0, fine.stderr
        assert fine.stderr.strip().splitlines()[-1] == "scored 3 ok"


def test_demo_with_its_ports_taken_moves_the_judges_or_names_the_port(tmp_path, redis_url):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        backend = judge_backend(f"http://127.0.0.1:{port}", rpm=6000, max_concurrent=16)
        config = write_config(tmp_path, {"j": backend}, routes={"demo": ["j"]}, route="demo")
        embedded = qrq("demo", "--prompts", "2", cwd=tmp_path, env={"QRQ_CONFIG": str(config)})
        assert embedded.returncode == 0, embedded.stdout + embedded.stderr
        assert f"port {port} of backend 'j' is taken; its mock judge runs at" \
            in embedded.stdout
        assert "Traceback" not in embedded.stderr
        distributed = qrq("demo", "--prompts", "2", cwd=tmp_path,
                          env={"QRQ_CONFIG": str(config), "QRQ_REDIS_URL": redis_url})
    assert distributed.returncode == 2
    line = error_line(distributed.stderr)
    assert f"port {port} of backend 'j' is taken" in line


def test_worker_with_an_unset_api_key_variable_refuses_to_start(tmp_path, redis_url):
    backend = judge_backend("http://127.0.0.1:9", api_key_env="QRQ_TEST_KEY_NOBODY_SET")
    config = write_config(tmp_path, {"j": backend}, redis_url=redis_url)
    result = qrq("worker", str(tmp_path / "workers" / "j.toml"), cwd=tmp_path,
                 env={"QRQ_CONFIG": str(config)}, timeout=60)
    assert result.returncode == 2
    line = error_line(result.stderr)
    assert "QRQ_TEST_KEY_NOBODY_SET" in line and "is not set" in line
    assert str(tmp_path / "workers" / "j.toml") in line


def test_a_batch_with_no_worker_warns_within_seconds_and_keeps_waiting(tmp_path, redis_url):
    with MockJudge(MockJudgeSettings(latency_ms=1, latency_cv=0)) as judge:
        config = write_config(tmp_path, {"j": judge_backend(judge.url)}, redis_url=redis_url,
                              routes={"r": ["j"]})
        samples = [{"prompt": f"{i}+1?", "response": str(i + 1)} for i in range(4)]
        (tmp_path / "in.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
        base = {k: v for k, v in os.environ.items() if not k.startswith("QRQ_")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "qreward_queue.cli", "score", "in.jsonl", "--route", "r",
             "--deadline-s", "120", "-o", "out.jsonl"],
            env={**base, "QRQ_CONFIG": str(config)}, cwd=tmp_path,
            stderr=subprocess.PIPE, text=True,
        )
        try:
            stderr = StderrReader(proc)
            warning = wait_for(lambda: stderr.line_with("no live worker"), timeout_s=10,
                               what="the no-worker warning")
            assert "queue qrq.j of backend 'j'" in warning
            assert f"`qrq worker {tmp_path / 'workers' / 'j.toml'}`" in warning
            assert proc.poll() is None  # still waiting for a worker
            with Worker(config, "j"):
                status = qrq("status", cwd=ROOT, env={"QRQ_CONFIG": str(config)})
                (row,) = [r for r in status.stdout.splitlines() if r.startswith("j ")]
                assert row.split()[4] == "1"  # one live worker (after samples queued and samples/s)
                assert proc.wait(60) == 0, stderr.text()
        finally:
            proc.kill()
    assert stderr.text().count("no live worker") == 1
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["status"] for o in out] == ["ok"] * 4


class StderrReader:
    """Lines a running process writes to stderr, collected by a thread as they come."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self.thread = threading.Thread(target=lambda: self.lines.extend(proc.stderr), daemon=True)
        self.thread.start()

    def line_with(self, text: str) -> str | None:
        return next((line for line in list(self.lines) if text in line), None)

    def text(self) -> str:
        self.thread.join(10)
        return "".join(self.lines)


def test_sizing_rule_without_any_limit_needs_the_wanted_rate():
    assert advised_calls(Limits(), 0.02, 2, want_per_s=1000) == 30
    with pytest.raises(ValueError):
        advised_calls(Limits(), 0.02)


@pytest.mark.parametrize("file", sorted(p.name for p in (ROOT / "workers").glob("*.toml")))
def test_k8s_has_one_deployment_per_pool_scaled_on_its_real_lists(file, redis_url):
    backend = load_backend(ROOT / "workers" / file)
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / f"worker-{backend.name}.yaml")
                                   .read_text()))
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (scaler,) = [d for d in docs if d["kind"] == "ScaledObject"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["qrq", "worker", f"workers/{file}"]
    assert scaler["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    env = {e["name"] for e in container["env"]}
    triggers = [t["metadata"] for t in scaler["spec"]["triggers"]]
    for trigger in triggers:  # KEDA reads these variables from the target's container
        assert {trigger["addressFromEnv"], trigger["passwordFromEnv"]} <= env
    # Given one message per priority on the backend's queue, the triggers name those lists
    config = load_config(ROOT / "qrq.toml")
    app = QrqCelery(dataclasses.replace(config, redis_url=redis_url))
    for priority in Priority:
        app.send_task("qrq.score_chunk", kwargs={}, queue=backend.queue, priority=priority.level)
    store = redis.Redis.from_url(redis_url)
    lists = {k.decode() for k in store.keys(f"qrq:{backend.queue}*")  # this queue's lists
             if store.type(k) == b"list"}
    watched = {t["listName"] for t in triggers}  # every priority level kombu may use
    assert lists <= watched == set(queue_lists(backend.queue))
    assert sum(store.llen(name) for name in watched) == len(Priority)


def test_connection_failure_names_the_url_without_credentials():
    port = free_port()
    backend = Backend(name="j", kind="judge", timeout_s=2,
                      options=JudgeOptions(url=f"http://user:pa55word@127.0.0.1:{port}/v1",
                      model="m"))
    with pytest.raises(TransientError) as caught:
        post_json(backend, f"{backend.options.url}/chat/completions", {"x": 1})
    assert f"connection to http://127.0.0.1:{port}/v1/chat/completions failed" \
        in str(caught.value)
    assert "pa55word" not in str(caught.value) and "user" not in str(caught.value)


def test_an_unset_api_key_fails_over_to_a_healthy_sibling(tmp_path, monkeypatch):
    # Given a route over two judges, one whose key variable is unset in this process
    monkeypatch.delenv("QRQ_TEST_KEY_NOBODY_SET", raising=False)
    with MockJudge(MockJudgeSettings(latency_ms=1, latency_cv=0)) as judge:
        backends = {
            "keyless": judge_backend(judge.url, api_key_env="QRQ_TEST_KEY_NOBODY_SET"),
            "open": judge_backend(judge.url),
        }
        config = write_config(tmp_path, backends, routes={"r": ["keyless", "open"]})
        app = qreward_queue.configure(config)  # embedded: one process serves both queues
        samples = [{"prompt": f"{i}+1?", "response": str(i + 1)} for i in range(12)]
        # When a batch is scored on the route
        outcomes = qreward_queue.submit_batch(samples, route="r", app=app).outcomes(timeout=60)
        # Then every sample is scored by the sibling, and the keyless backend sent nothing
        assert [o.status for o in outcomes] == ["ok"] * 12
        assert {o.backend for o in outcomes} == {"open"}
        assert judge.stats()["requests"] == 12
    # and alone, the same backend gives an error naming the variable, once per sample
    only = qreward_queue.submit_batch(samples[:2], route="keyless", app=app).outcomes(timeout=60)
    assert all(o.status == "error" and "QRQ_TEST_KEY_NOBODY_SET" in o.error for o in only)
    assert all(o.attempts == 1 and "(no call made on 'keyless'" in o.error for o in only)


class _Terminal(io.StringIO):
    """stderr as a terminal shows it (tqdm draws only on a terminal)."""

    def isatty(self) -> bool:
        return True


def test_demo_shows_progress_while_the_naive_loop_runs(monkeypatch, tmp_path):
    from qreward_queue.cli.demo import grpo_batch, progress_bar
    from qreward_queue.cli.demo_clients import naive_score

    samples = grpo_batch(n_prompts=2)  # 16 samples
    screen = _Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    with MockJudge(MockJudgeSettings(latency_ms=1, latency_cv=0)) as judge:
        config = write_config(tmp_path, {"j": judge_backend(judge.url)}, routes={"r": ["j"]})
        backend = load_config(config).backends["j"]
        with progress_bar(len(samples), "naive loop") as advance:
            scores = naive_score(backend, samples, advance)
    frames = screen.getvalue().split("\r")
    assert len(scores) == 16
    for done in range(1, 17):  # drawn after each sample, while the loop runs
        assert any(f.startswith("naive loop:") and f" {done}/16 " in f for f in frames), done


def test_package_metadata_matches_its_license_file_and_needs_no_http_client():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    head = " ".join((ROOT / "LICENSE").read_text().split()[:5])
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert head == "Apache License Version 2.0, January"
    assert "Programming Language :: Python :: 3.10" in project["classifiers"]
    assert project["requires-python"] == ">=3.10"
    # the demo's clients are the standard library's: `requests` only where a command needs it
    assert not [d for d in project["dependencies"] if d.startswith("requests")]
    assert any(d.startswith("requests") for d in project["optional-dependencies"]["metrics"])
