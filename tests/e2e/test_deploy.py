"""docker-compose.yml cannot start here (no Docker engine), so: it parses, and every service's
command runs on this machine against a local Redis. deploy/k8s/ is rendered from workers/*.toml,
checked against the Kubernetes schemas, and its KEDA triggers against qrq's queue lists."""

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

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
K8S = ROOT / "deploy" / "k8s"
WORKER_FILES = sorted(p.stem for p in (ROOT / "workers").glob("*.toml"))


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
    assert SERVICES[service]["environment"]["QRQ_METRICS_PORT"]
    port = free_port()
    env = {**os.environ, "QRQ_REDIS_URL": redis_url, "QRQ_CONFIG": str(ROOT / "qrq.toml"),
           "QRQ_METRICS_PORT": str(port)}
    cmd = [sys.executable, "-m", "qreward_queue.cli", *command_of(service)[1:]]
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 40
        while "ready." not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        assert requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).ok
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


def test_exporter_service_command_serves_the_redis_state(redis_url):
    cmd = [sys.executable, "-m", "qreward_queue.cli", *command_of("exporter")[1:]]
    port = cmd[cmd.index("--port") + 1]
    env = {**os.environ, "QRQ_REDIS_URL": redis_url, "QRQ_CONFIG": str(ROOT / "qrq.toml")}

    def page() -> str:
        try:
            return requests.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
        except requests.RequestException:
            return ""

    proc = run_until(cmd, page, env)
    try:
        text = page()
        for backend in WORKER_FILES:
            assert f'qrq_queue_depth{{backend="{backend}",priority="train"}} 0.0' in text
    finally:
        stop(proc)


def k8s_docs(name: str) -> list[dict]:
    return list(yaml.safe_load_all((K8S / name).read_text()))


def test_k8s_has_one_pool_per_worker_file_and_is_up_to_date():
    out = subprocess.run([sys.executable, str(K8S / "render.py"), "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(p.stem.removeprefix("worker-") for p in K8S.glob("worker-*.yaml")) \
        == WORKER_FILES


def test_a_new_backend_file_renders_a_new_pool(tmp_path):
    sys.path.insert(0, str(K8S))
    from render import render

    (tmp_path / "workers").mkdir()
    (tmp_path / "workers" / "new-judge.toml").write_text(
        (ROOT / "workers" / "mock-a.toml").read_text())
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "redis.conf").write_text("appendonly yes\n")
    assert "worker-new-judge.yaml" in render(tmp_path)
    assert not (K8S / "worker-new-judge.yaml").exists()  # so --check would fail on it


def test_k8s_manifests_pass_the_kubernetes_schemas():
    import kubernetes_validate

    checked = 0
    for path in sorted(K8S.glob("*.yaml")):
        for doc in k8s_docs(path.name):
            if doc["apiVersion"].startswith("keda.sh/"):
                continue  # a CRD: checked against qrq's queues below
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
            checked += 1
    # a Deployment per pool, Redis x3, exporter x2, Flower x3, the Redis Secret example
    assert checked == len(WORKER_FILES) + 5 + 3 + 1


@pytest.mark.parametrize("backend", WORKER_FILES)
def test_each_pool_runs_non_root_and_scales_on_every_priority_list(backend):
    from qreward_queue.config.loader import load_backend
    from qreward_queue.keys import queue_lists

    deployment, scaled = k8s_docs(f"worker-{backend}.yaml")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["qrq", "worker", f"workers/{backend}.toml"]
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text().splitlines()
    user = [line.split()[1] for line in dockerfile if line.startswith("USER ")][-1]
    assert user.isdigit() and int(user) != 0
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == int(user)
    # KEDA: one trigger per priority list of the queue, summed by the formula
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    lists = dict(enumerate(queue_lists(load_backend(ROOT / "workers" / f"{backend}.toml").queue)))
    assert [t["metadata"]["listName"] for t in spec["triggers"]] == list(lists.values())
    names = [t["name"] for t in spec["triggers"]]
    formula = spec["advanced"]["scalingModifiers"]["formula"]
    assert formula.split(" + ") == names
    assert all(t["metadata"]["passwordFromEnv"] in {e["name"] for e in container["env"]}
               for t in spec["triggers"])


def test_k8s_redis_keeps_an_aof_and_needs_a_password():
    conf, statefulset, _ = k8s_docs("redis.yaml")
    assert conf["data"]["redis.conf"] == (ROOT / "deploy" / "redis.conf").read_text()
    assert "appendonly yes" in conf["data"]["redis.conf"]
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert '--requirepass "$REDIS_PASSWORD"' in container["command"][-1]
    assert statefulset["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


COMPOSE_IMAGE = "qreward-queue:latest"
SENTINEL_VARIANT = yaml.safe_load((ROOT / "deploy" / "compose.sentinel.yml").read_text())


def test_the_sentinel_variant_points_every_qrq_service_at_the_sentinels():
    qrq_services = {s for s, spec in SERVICES.items() if spec.get("image") == COMPOSE_IMAGE}
    variant = SENTINEL_VARIANT["services"]
    assert qrq_services <= set(variant)
    for service in qrq_services:
        env = variant[service]["environment"]
        assert env["QRQ_REDIS_URL"].count("sentinel://") == 3, service
        assert env["QRQ_REDIS_SERVICE_NAME"] == "qrq"
    conf = (ROOT / "deploy" / "sentinel.conf").read_text()
    assert "sentinel monitor qrq redis 6379 2" in conf


def test_the_sentinel_variant_commands_run_and_qrq_finds_the_primary(tmp_path):
    # Given the variant's primary, replica and sentinel commands, run here on free ports
    # (compose's hostnames made local)
    import redis

    variant, env = SENTINEL_VARIANT["services"], {**os.environ, "REDIS_PASSWORD": "s3cret"}
    ports = {"redis": free_port(), "redis-replica": free_port(), "sentinel": free_port()}
    procs = []

    def local(cmd: str, port: int) -> list[str]:
        cmd = (cmd.replace("${REDIS_PASSWORD:?set REDIS_PASSWORD}", "s3cret")
               .replace("/etc/redis/redis.conf", str(ROOT / "deploy" / "redis.conf"))
               .replace("--replicaof redis 6379", f"--replicaof 127.0.0.1 {ports['redis']}"))
        where = ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path / str(port))]
        return [*shlex.split(cmd), *where]

    def answers(port: int, **auth) -> bool:
        try:
            return redis.Redis(port=port, socket_connect_timeout=0.5, **auth).ping()
        except redis.RedisError:
            return False

    conf = tmp_path / "sentinel.conf"
    conf.write_text((ROOT / "deploy" / "sentinel.conf").read_text()
                    .replace("port 26379", f"port {ports['sentinel']}\nbind 127.0.0.1")
                    .replace("qrq redis 6379 2", f"qrq 127.0.0.1 {ports['redis']} 1"))
    sentinel_cmd = (variant["sentinel-1"]["command"].replace("$$", "$")
                    .replace("/etc/redis/sentinel.conf", str(conf))
                    .replace("/tmp/sentinel.conf", str(tmp_path / "running.conf")))
    try:
        for name in ("redis", "redis-replica"):
            (tmp_path / str(ports[name])).mkdir()
            procs.append(run_until(local(variant[name]["command"], ports[name]),
                                   lambda p=ports[name]: answers(p, password="s3cret"), env))
        procs.append(run_until(shlex.split(sentinel_cmd), lambda: answers(ports["sentinel"]),
                               env))
        # When qrq status runs with the variant's QRQ_REDIS_URL
        url = variant["worker-mock-a"]["environment"]["QRQ_REDIS_URL"]
        url = ";".join(u.replace("${REDIS_PASSWORD:?set REDIS_PASSWORD}", "s3cret")
                       .replace("sentinel-1:26379", f"127.0.0.1:{ports['sentinel']}")
                       for u in url.split(";")[:1])
        out = subprocess.run(
            [sys.executable, "-m", "qreward_queue.cli", "status"], cwd=ROOT, timeout=60,
            capture_output=True, text=True,
            env={**env, "QRQ_REDIS_URL": url, "QRQ_CONFIG": str(ROOT / "qrq.toml"),
                 "QRQ_REDIS_SERVICE_NAME": "qrq"},
        )
        # Then it reaches the primary through the sentinel, with the password from the URL
        assert out.returncode == 0, out.stdout + out.stderr
        assert "service 'qrq' via sentinels 127.0.0.1:" in out.stdout
        assert "s3cret" not in out.stdout + out.stderr
    finally:
        for proc in procs:
            stop(proc)
