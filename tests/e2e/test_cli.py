"""The `qrq` command line: `qrq score` end to end in embedded mode, and one-line errors (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from support import ROOT, judge_backend, write_config

from qreward_queue.backends.judge import JudgeBackend
from qreward_queue.cli.main import cli
from qreward_queue.config.loader import load_config
from qreward_queue.testing.mock_judge import MockJudge, MockJudgeSettings, verdict

MODE_LINE = "qrq: embedded mode"


@pytest.fixture(autouse=True)
def no_qrq_env(monkeypatch):
    monkeypatch.delenv("QRQ_REDIS_URL", raising=False)
    monkeypatch.delenv("QRQ_CONFIG", raising=False)


@pytest.fixture
def judge() -> Iterator[MockJudge]:
    with MockJudge(MockJudgeSettings(latency_ms=2, latency_cv=0, hang_s=8.0)) as mock:
        yield mock


@pytest.fixture
def config_path(tmp_path, judge) -> Path:
    return write_config(
        tmp_path,
        {"j": judge_backend(judge.url, concurrency=8)},
        routes={"grade": ["j"]},
        fallback_score=-1.0,
    )


def start_qrq(*args: str, config: Path | None = None) -> subprocess.Popen[str]:
    """Start `python -m qreward_queue.cli ...` as a user would, with QRQ_CONFIG pointing at
    config, its stdout and stderr piped."""
    env = {k: v for k, v in os.environ.items() if k not in ("QRQ_REDIS_URL", "QRQ_CONFIG")}
    if config is not None:
        env["QRQ_CONFIG"] = str(config)
    return subprocess.Popen(
        [sys.executable, "-m", "qreward_queue.cli", *args],
        env=env,
        cwd=config.parent if config else ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def qrq(*args: str, config: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run `python -m qreward_queue.cli ...` to its end (killed if it outlives `timeout`)."""
    with start_qrq(*args, config=config) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def one_error_line(stderr: str) -> str:
    """The single `qrq: error: ...` line of stderr (there must be exactly one, no traceback)."""
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("qrq: error: ")]
    assert len(errors) == 1, stderr
    return errors[0]


def test_score_writes_one_outcome_per_line_in_order(tmp_path, config_path, judge):
    good = [
        {"prompt": f"What is {i} + 1?", "response": str(i + 1), "id": f"s{i}"} for i in range(12)
    ]
    lines = [json.dumps(s) for s in good[:5]]
    lines.append("this is not json {")  # line 6
    lines += [json.dumps(s) for s in good[5:9]]
    lines.append("")  # a blank line is skipped
    lines.append(json.dumps({"prompt": "no response here", "id": "m"}))  # line 12
    lines += [json.dumps(s) for s in good[9:]]
    lines.append(json.dumps({"prompt": "p", "response": "[[mock:400]]", "id": "r"}))
    lines.append('{"prompt": "p", "response": "r", "extra": {"x": NaN}, "id": "nan"}')
    lines.append("[1, 2]")
    in_file, out_file = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    in_file.write_text("\n".join(lines) + "\n")

    result = qrq("score", str(in_file), "-o", str(out_file), "--route", "grade", config=config_path)
    assert result.returncode == 1, result.stderr  # some samples were not scored
    assert result.stderr.splitlines()[0].startswith(MODE_LINE)
    assert "Traceback" not in result.stderr
    assert "scored 5 error, 12 ok" in result.stderr

    out = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert len(out) == 17  # one per non-blank input line
    assert [o["index"] for o in out] == list(range(17))
    by_id = {o["id"]: o for o in out if o["id"] is not None}
    renderer = JudgeBackend(load_config(config_path).backends["j"])
    for sample in good:
        outcome = by_id[sample["id"]]
        assert outcome["status"] == "ok"
        assert outcome["score"] == verdict(renderer.render(sample))
        assert outcome["backend"] == "j" and outcome["attempts"] >= 1
    ids_in_order = [o["id"] for o in out]
    assert ids_in_order == [
        *[s["id"] for s in good[:5]],
        None,
        *[s["id"] for s in good[5:9]],
        "m",
        *[s["id"] for s in good[9:]],
        "r",
        "nan",
        None,
    ]
    not_json, missing, rejected = out[5], out[10], out[14]
    assert not_json["status"] == "error" and not_json["error"].startswith("line 6: not JSON")
    assert missing["status"] == "error" and "missing field 'response'" in missing["error"]
    assert rejected["status"] == "error" and "400" in rejected["error"]
    nan, not_object = out[15], out[16]
    assert nan["status"] == "error" and "not JSON-serializable" in nan["error"]
    assert not_object["status"] == "error" and "got list" in not_object["error"]
    assert {o["score"] for o in (not_json, missing, rejected, nan, not_object)} == {-1.0}
    assert judge.stats()["accepted"] == 12


def test_score_unknown_route_is_one_line_and_exit_2(tmp_path, config_path, judge):
    in_file = tmp_path / "in.jsonl"
    in_file.write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n")
    result = qrq("score", str(in_file), "--route", "gradee", config=config_path)
    assert result.returncode == 2
    line = one_error_line(result.stderr)
    assert "unknown route or backend 'gradee'" in line and "known: grade, j" in line
    assert result.stdout == ""
    assert judge.stats()["requests"] == 0


def test_score_line_of_invalid_utf8_is_an_error_outcome(tmp_path, config_path):
    in_file = tmp_path / "in.jsonl"
    in_file.write_bytes(
        b'{"prompt": "a", "response": "b"}\n'
        b"\xff\xfe latin-1 junk\n"
        b'{"prompt": "c", "response": "d"}\n'
    )
    result = qrq("score", str(in_file), "--route", "grade", config=config_path)
    assert "Traceback" not in result.stderr
    assert result.returncode == 1, result.stderr
    out = [json.loads(line) for line in result.stdout.splitlines()]
    assert [o["status"] for o in out] == ["ok", "error", "ok"]
    assert out[1]["error"].startswith("line 2:")


def test_score_deadline_returns_on_time_with_timeouts(tmp_path, config_path):
    in_file = tmp_path / "in.jsonl"
    samples = [{"prompt": "p", "response": "fine"}, {"prompt": "p", "response": "[[mock:hang]]"}]
    in_file.write_text("".join(json.dumps(s) + "\n" for s in samples))
    with start_qrq("score", str(in_file), "--route", "grade", "--deadline-s", "2",
                   config=config_path) as proc:
        mode = proc.stderr.readline()  # said as the batch is about to be submitted
        said = time.monotonic()
        first = proc.stdout.readline()  # the outcomes are written (and flushed) all at once
        written_in = time.monotonic() - said
        stdout, stderr = first + proc.stdout.read(), proc.stderr.read()  # to the exit
    assert mode.startswith(MODE_LINE), mode + stderr
    assert proc.returncode == 1, stderr
    out = [json.loads(line) for line in stdout.splitlines()]  # -o defaults to stdout
    assert [o["status"] for o in out] == ["ok", "timeout"]
    assert out[1]["score"] == -1.0
    # deadline promise: the outcomes are written at the 2 s deadline, before stopping the
    # embedded workers lets the in-flight call end (hang_s 8); 2 s of room for start-up
    assert written_in < 2 + 2, written_in


# --- one-line errors without a worker (in-process through click's runner) ----------------------


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), prog_name="qrq")


def test_broken_config_is_one_line_naming_file_and_key(tmp_path):
    config_path = write_config(tmp_path, {"j": judge_backend("http://127.0.0.1:9")})
    (tmp_path / "workers" / "j.toml").write_text(
        '[backend]\nkind = "judge"\nurl = "http://h/v1"\nmodel = "m"\n[pool]\nrate_limit = "fast"\n'
    )
    in_file = tmp_path / "in.jsonl"
    in_file.write_text("{}\n")
    result = invoke("score", str(in_file), "--config", str(config_path))
    assert result.exit_code == 2
    assert result.stdout == ""
    line = one_error_line(result.stderr)
    assert result.stderr.strip() == line  # nothing else: not even the mode line
    assert str(tmp_path / "workers" / "j.toml") in line and "pool.rate_limit" in line
    assert "'fast'" in line


def test_invalid_toml_via_qrq_config_env(tmp_path, monkeypatch):
    broken = tmp_path / "qrq.toml"
    broken.write_text("[defaults\n")
    monkeypatch.setenv("QRQ_CONFIG", str(broken))
    in_file = tmp_path / "in.jsonl"
    in_file.write_text("{}\n")
    result = invoke("score", str(in_file))
    assert result.exit_code == 2
    line = one_error_line(result.stderr)
    assert str(broken) in line and "not valid TOML" in line


def test_worker_without_redis_is_one_clear_line(tmp_path):
    config_path = write_config(tmp_path, {"j": judge_backend("http://127.0.0.1:9")})
    result = invoke("worker", str(tmp_path / "workers" / "j.toml"), "--config", str(config_path))
    assert result.exit_code == 2
    line = one_error_line(result.stderr)
    assert "needs Redis" in line and "QRQ_REDIS_URL" in line
    assert result.stderr.strip() == line


def test_worker_with_a_broken_backend_file(tmp_path):
    config_path = write_config(tmp_path, {"j": judge_backend("http://127.0.0.1:9")})
    other = tmp_path / "other.toml"
    other.write_text('[backend]\nkind = "judge"\n')
    result = invoke("worker", str(other), "--config", str(config_path))
    assert result.exit_code == 2
    line = one_error_line(result.stderr)
    assert str(other) in line and "backend.url" in line


def test_mock_judge_help():
    result = invoke("mock-judge", "--help")
    assert result.exit_code == 0
    for option in ("--rpm", "--tpm", "--max-concurrent", "--latency-ms", "--hang-s", "--port"):
        assert option in result.stdout


def test_top_level_help_lists_the_commands():
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("score", "worker", "mock-judge", "demo", "status"):
        assert command in result.stdout


def test_missing_input_file_is_a_usage_error_not_a_traceback(tmp_path):
    result = invoke("score", str(tmp_path / "absent.jsonl"))
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert "absent.jsonl" in result.stderr
