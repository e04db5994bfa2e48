"""`qrq init` (a newcomer's own judge: the files it writes load, start a worker and score),
`qrq dead-letters` with none, and `qrq score`'s progress bar after a Ctrl-C."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from tqdm import tqdm

from qreward_queue.backends.judge import JudgeBackend
from qreward_queue.cli.main import cli, settle_bar
from qreward_queue.config.loader import load_config
from qreward_queue.errors import Cancelled, DeadlineExceeded
from qreward_queue.samples import Outcome
from qreward_queue.testing.mock_judge import MockJudge, MockJudgeSettings, verdict


@pytest.fixture(autouse=True)
def no_qrq_env(monkeypatch):
    monkeypatch.delenv("QRQ_REDIS_URL", raising=False)
    monkeypatch.delenv("QRQ_CONFIG", raising=False)


def invoke(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(cli, list(args), prog_name="qrq", env=env)


def user_env(**extra: str) -> dict[str, str]:
    """This environment without QRQ_* variables, plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("QRQ_")}, **extra}


def test_init_writes_files_that_load_start_a_worker_and_score(tmp_path, redis_url):
    with MockJudge(MockJudgeSettings(latency_ms=2, latency_cv=0, rpm=6000)) as judge:
        base_url = judge.url + "/v1"  # the OpenAI-compatible base URL a user gives
        result = invoke("init", "--judge-url", base_url, "--model", "my-judge-model",
                        "--rpm", "6000", "--max-concurrent", "16", "--dir", str(tmp_path))
        assert result.exit_code == 0, result.output
        assert result.stdout.splitlines()[:2] == [f"wrote {tmp_path / 'qrq.toml'}",
                                                  f"wrote {tmp_path / 'workers' / 'judge.toml'}"]
        text = (tmp_path / "qrq.toml").read_text() + (tmp_path / "workers/judge.toml").read_text()
        assert text.count("\n# ") >= 10  # commented for a reader, not bare keys

        config = load_config(tmp_path / "qrq.toml")  # the project's own loader
        backend = config.backends["judge"]
        assert (backend.kind, backend.options.url, backend.options.model) == (
        "judge", base_url, "my-judge-model")
        assert (backend.limits.rpm, backend.limits.max_concurrent) == (6000, 16)
        assert backend.pool.sized and backend.api_key_env is None
        assert config.default_route == "judge" and config.routes["judge"].backends == ("judge",)

        # `qrq worker`'s start-up checks accept the file; then a sample goes through it
        env = user_env(QRQ_REDIS_URL=redis_url, QRQ_CONFIG=str(tmp_path / "qrq.toml"))
        log = tmp_path / "worker.log"
        with log.open("w") as fh:
            worker = subprocess.Popen(
                [sys.executable, "-m", "qreward_queue.cli", "worker", "workers/judge.toml"],
                cwd=tmp_path, env=env, stdout=fh, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while "ready." not in log.read_text():
                assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            assert "worker for backend 'judge' on queue qrq.judge" in log.read_text()
            samples = [{"prompt": f"What is {i} + 2?", "response": str(i + 2)} for i in range(4)]
            (tmp_path / "in.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
            run = subprocess.run(
                [sys.executable, "-m", "qreward_queue.cli", "score", "in.jsonl", "-o", "out.jsonl"],
                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        finally:
            worker.terminate()
            worker.wait(30)
        assert run.returncode == 0, run.stderr
        out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
        renderer = JudgeBackend(backend)
        assert [o["status"] for o in out] == ["ok"] * 4
        assert [o["score"] for o in out] == [verdict(renderer.render(s)) for s in samples]
        assert judge.stats()["accepted"] == 4


def test_init_writes_a_key_variable_s_name_and_the_route_it_is_given(tmp_path):
    result = invoke("init", "--judge-url", "https://judge.example/v1", "--model", "m",
                    "--name", "grader", "--api-key-env", "GRADER_KEY", "--dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    config = load_config(tmp_path / "qrq.toml")
    assert config.backends["grader"].api_key_env == "GRADER_KEY"
    assert config.backends["grader"].limits.rpm is None  # no limit invented
    assert config.route(None).name == "grader"


def test_init_never_writes_over_a_file(tmp_path):
    (tmp_path / "qrq.toml").write_text("# mine\n")
    result = invoke("init", "--judge-url", "http://127.0.0.1:8000/v1", "--model", "m",
                    "--dir", str(tmp_path))
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"qrq: error: {tmp_path / 'qrq.toml'} exists: qrq init writes only new files (move it "
        "away, or give --dir another directory)"]
    assert (tmp_path / "qrq.toml").read_text() == "# mine\n"
    assert not (tmp_path / "workers").exists()  # nothing half-written


@pytest.mark.parametrize("flags, named", [
    (["--judge-url", "127.0.0.1:8000/v1", "--model", "m"], "--judge-url"),
    (["--judge-url", "http://h/v1", "--model", "m", "--api-key-env", "sk-abc123"],
     "--api-key-env"),
    (["--judge-url", "http://h/v1", "--model", "m", "--name", "a b"], "--name"),
])
def test_init_bad_flag_is_one_line_naming_it(tmp_path, flags, named):
    result = invoke("init", *flags, "--dir", str(tmp_path))
    assert result.exit_code == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"qrq: error: {named}: ")
    assert not (tmp_path / "qrq.toml").exists()


def test_dead_letters_says_when_there_are_none(redis_url, redis_client, tmp_path):
    from qreward_queue.ops.dead_letter import record

    (tmp_path / "workers").mkdir()
    (tmp_path / "qrq.toml").write_text("")
    args = ("dead-letters", "--config", str(tmp_path / "qrq.toml"))
    result = invoke(*args, env={"QRQ_REDIS_URL": redis_url})
    assert result.exit_code == 0, result.output
    assert result.stdout == ""  # stdout stays one JSON line per letter, for scripts
    assert result.stderr.startswith(f"qrq: no dead letters in Redis at {redis_url}")

    record(redis_client, "malformed message", queue="qrq.j")
    result = invoke(*args, env={"QRQ_REDIS_URL": redis_url})
    assert result.exit_code == 0 and result.stderr == ""
    (line,) = result.stdout.splitlines()
    assert json.loads(line)["reason"] == "malformed message"


def test_score_bar_after_ctrl_c_counts_cancelled_samples_as_cancelled():
    """The bar's last state once the batch was cancelled: 3 scored, 4 cancelled, 1 timeout."""
    ok = Outcome(score=1.0, status="ok", backend="j", attempts=1)
    outcomes = [ok] * 3 + [Outcome.failed(Cancelled("interrupted"))] * 4 \
        + [Outcome.failed(DeadlineExceeded("late"))]
    screen = io.StringIO()
    bar = tqdm(total=8, file=screen, disable=False, ascii=True)
    bar.update(7)  # what the loop showed when Ctrl-C came: outcomes it had counted in
    settle_bar(bar, outcomes)
    bar.close()
    last = screen.getvalue().split("\r")[-1]
    assert last.startswith("cancelled:") and " 3/8 " in last
    assert "4 cancelled, 3 ok, 1 timeout" in last
