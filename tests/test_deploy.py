"""docker-compose.yml cannot start here (no Docker engine), so: it parses, and every service's
command runs on this machine against a local Redis."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml
from support import free_port

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]




def command_of(service: str) -> list[str]:
    """The service's command with compose's ${VAR:?...} filled and hosts made local."""
    cmd = SERVICES[service]["command"]
    cmd = cmd.replace("${REDIS_PASSWORD:?set REDIS_PASSWORD}", "s3cret").replace(
        "0.0.0.0", "127.0.0.1")
    return shlex.split(cmd)


def run_until(cmd: list[str], ready, env: dict, timeout_s: float = 40.0, cwd=ROOT):
    """Start `cmd`; wait until ready() is true; return the process (caller stops it)."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out = proc.stdout.read()[-3000:]
            raise AssertionError(f"{cmd} did not come up:\n{out}")
        time.sleep(0.2)
    return proc


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_compose_parses_with_one_worker_service_per_backend_file():
    workers = {Path(p).stem for p in os.listdir(ROOT / "workers") if p.endswith(".toml")}
    commands = {s: spec.get("command", "") for s, spec in SERVICES.items()}
    served = {shlex.split(c)[2].removeprefix("workers/").removesuffix(".toml")
              for c in commands.values() if c.startswith("qrq worker ")}
    assert served == workers
    assert "--requirepass" in commands["redis"]
    assert "FLOWER_BASIC_AUTH" in SERVICES["flower"]["environment"]
    conf = (ROOT / "deploy" / "redis.conf").read_text()
    assert "appendonly yes" in conf and "maxmemory-policy noeviction" in conf


def test_redis_service_command_runs_with_password_and_aof(tmp_path):
    port = free_port()
    cmd = [c.replace("/etc/redis/redis.conf", str(ROOT / "deploy" / "redis.conf"))
           for c in command_of("redis")] + ["--port", str(port), "--dir", str(tmp_path),
                                            "--bind", "127.0.0.1"]
    import redis

    client = redis.Redis(port=port, password="s3cret")

    def up() -> bool:
        try:
            return client.ping()
        except redis.RedisError:
            return False

    proc = run_until(cmd, up, dict(os.environ))
    try:
        assert client.config_get("appendonly")["appendonly"] == "yes"
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
    finally:
        stop(proc)


@pytest.mark.parametrize("service", [s for s in SERVICES if s.startswith("worker-")])
def test_worker_service_commands_start(service, redis_url, tmp_path):
    log = tmp_path / "worker.log"
    env = {**os.environ, "QRQ_REDIS_URL": redis_url, "QRQ_CONFIG": str(ROOT / "qrq.toml")}
    cmd = [sys.executable, "-m", "qreward_queue.cli", *command_of(service)[1:]]
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 40
        while "ready." not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
    finally:
        stop(proc)


@pytest.mark.parametrize("service", [s for s in SERVICES if s.startswith("mock-")])
def test_mock_judge_service_commands_serve(service):
    cmd = [sys.executable, "-m", "qreward_queue.cli", *command_of(service)[1:]]
    port = cmd[cmd.index("--port") + 1]
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return requests.get(f"{url}/health", timeout=1).ok
        except requests.RequestException:
            return False

    proc = run_until(cmd, up, dict(os.environ))
    try:
        reply = requests.post(f"{url}/v1/chat/completions", timeout=5, json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 200 and "Score:" in reply.text
    finally:
        stop(proc)


def test_flower_service_command_serves_with_auth(redis_url):
    port = free_port()
    cmd = [c for c in command_of("flower") if not c.startswith("--port")] + [f"--port={port}"]
    cmd[0] = str(Path(sys.executable).parent / "celery")
    env = {**os.environ, "QRQ_REDIS_URL": redis_url, "QRQ_CONFIG": str(ROOT / "qrq.toml"),
           "FLOWER_BASIC_AUTH": "admin:s3cret"}
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return requests.get(f"{url}/healthcheck", timeout=1).ok
        except requests.RequestException:
            return False

    proc = run_until(cmd, up, env)
    try:
        assert requests.get(f"{url}/api/workers", timeout=5).status_code == 401
        # Flower's own behaviour, documented in README "Hardening": these two need no password,
        # which is why compose and deploy/k8s keep Flower's port private
        assert requests.get(f"{url}/metrics", timeout=10).status_code == 200
        assert requests.get(f"{url}/api/workers", auth=("admin", "s3cret"), timeout=10).ok
    finally:
        stop(proc)
