"""Helpers for tests: config files on disk, real `qrq worker` subprocesses, and calls ended
through the limiter as the worker ends them."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis
import requests

from qreward_queue.backends import KINDS
from qreward_queue.config.model import Backend
from qreward_queue.flow.limiter import Grant, Limiter, Reading
from qreward_queue.flow.ratelimit_headers import Feedback

ROOT = Path(__file__).resolve().parent.parent


def backend_of(kind: str, **fields) -> Backend:
    """A Backend made in Python from flat keyword arguments, as a file writes them: those of
    the kind's options dataclass go to `options`, the rest to Backend itself."""
    own = {f.name for f in dataclasses.fields(KINDS[kind].Options)}
    options = KINDS[kind].Options(**{k: v for k, v in fields.items() if k in own})
    return Backend(kind=kind, options=options, **{k: v for k, v in fields.items() if k not in own})


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


def toml_tables(tables: dict[str, dict]) -> str:
    """Render {"backend": {...}, "limits": {...}} as TOML tables."""
    out = []
    for name, table in tables.items():
        out.append(f"[{name}]")
        out += [f"{k} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(out) + "\n"


def judge_backend(
    url: str, *, rpm=0, max_concurrent=32, concurrency=8, calls=32, **backend
) -> dict:
    """A judge backend definition pointing at a mock judge: `concurrency` chunk tasks and
    `calls` backend calls at once per worker process."""
    return {
        "backend": {
            "kind": "judge",
            "url": url + "/v1",
            "model": "mock",
            "timeout_s": 10,
            **backend,
        },
        "limits": {"rpm": rpm, "max_concurrent": max_concurrent},
        "pool": {"type": "threads", "concurrency": concurrency, "calls": calls},
        "retry": {"attempts": 3, "backoff_base_s": 0.1, "backoff_cap_s": 1.0},
    }


def write_config(
    directory: Path,
    backends: dict[str, dict],
    redis_url: str | None = None,
    routes: dict[str, list[str]] | None = None,
    **defaults,
) -> Path:
    """qrq.toml plus workers/<name>.toml under `directory`; returns the qrq.toml path."""
    workers = directory / "workers"
    workers.mkdir(parents=True, exist_ok=True)
    for name, tables in backends.items():
        (workers / f"{name}.toml").write_text(toml_tables(tables))
    lines = ['workers_dir = "workers"']
    if redis_url:
        lines += ["[redis]", f"url = {toml_value(redis_url)}"]
    lines += ["[defaults]"] + [f"{k} = {toml_value(v)}" for k, v in defaults.items()]
    for name, members in (routes or {}).items():
        lines += [f"[routes.{name}]", f"backends = {toml_value(members)}"]
    path = directory / "qrq.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


class Worker:
    """A real `qrq worker` subprocess; waits until Celery says it is ready."""

    def __init__(
        self,
        config: Path,
        backend: str,
        name: str | None = None,
        timeout_s=30.0,
        extra_env: dict[str, str] | None = None,
        extra_args: tuple[str, ...] = (),
        launcher: tuple[str, ...] = ("-m", "qreward_queue.cli"),
    ):
        """`launcher`: what python runs instead of `-m qreward_queue.cli` (e.g. `-c` code that
        registers a test-only backend kind before it calls the CLI)."""
        self.log = config.parent / f"worker-{name or backend}-{time.monotonic_ns()}.log"
        env = {**os.environ, "QRQ_CONFIG": str(config), **(extra_env or {})}
        env.pop("QRQ_REDIS_URL", None)
        cmd = [
            sys.executable,
            *launcher,
            "worker",
            str(config.parent / "workers" / f"{backend}.toml"),
            "--loglevel",
            "INFO",
            *extra_args,
        ]
        if name:
            cmd += ["-n", name]
        with self.log.open("w") as fh:
            self.proc = subprocess.Popen(
                cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while "ready." not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"worker did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL the whole worker (main process and pool children)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# --- Helpers for the end-to-end tests (test_e2e_redis, test_priority, test_worker_loss) ---


def wait_for(predicate, timeout_s: float, what: str = "a condition", interval_s: float = 0.05):
    """Poll `predicate` until it returns something truthy (and return that), or fail the test."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def function_backend(function: str, *, chunk_size=16, pool="prefork", concurrency=2) -> dict:
    """A `function` backend definition (a Python reward by import path)."""
    return {
        "backend": {"kind": "function", "function": function, "chunk_size": chunk_size},
        "pool": {"type": pool, "concurrency": concurrency},
    }


def reward_model_backend(url: str, *, batch_size=8, concurrency=4, **backend) -> dict:
    """A reward-model backend definition pointing at a mock judge's /v1/rewards."""
    return {
        "backend": {
            "kind": "reward_model",
            "url": url + "/v1/rewards",
            "batch_size": batch_size,
            "timeout_s": 10,
            **backend,
        },
        "pool": {"type": "threads", "concurrency": concurrency},
        "retry": {"attempts": 3, "backoff_base_s": 0.1, "backoff_cap_s": 1.0},
    }


def redis_contents(client) -> list[tuple[bytes, bytes]]:
    """(key, stored bytes) for every value in the client's database, whatever the key's type."""
    found = []
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        if kind == b"string":
            values = [client.get(key) or b""]
        elif kind == b"list":
            values = client.lrange(key, 0, -1)
        elif kind == b"hash":
            values = [b for pair in client.hgetall(key).items() for b in pair]
        elif kind == b"set":
            values = list(client.smembers(key))
        elif kind == b"zset":
            values = [m for m, _ in client.zrange(key, 0, -1, withscores=True)]
        elif kind == b"stream":
            values = [b for _, entry in client.xrange(key) for pair in entry.items() for b in pair]
        else:  # the key expired between SCAN and TYPE
            values = []
        found += [(key, key)] + [(key, v) for v in values]
    return found


def child_pids(pid: int) -> list[int]:
    """Direct children of process `pid` (from /proc, so psutil is not needed)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(p) for p in (task / "children").read_text().split()]
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(set(children))


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def recording_exact_match(sample: dict) -> float:
    """exact_match that first appends its pid to extra["pid_file"] and sleeps extra["sleep_s"].

    For worker-loss tests: the test learns which pool child runs the sample and can kill it.
    """
    from qreward_queue.rewards.basic import exact_match

    extra = sample.get("extra") or {}
    if extra.get("pid_file"):  # the function runs in a helper process of the pool child
        with open(extra["pid_file"], "a") as fh:
            fh.write(f"{os.getppid()}\n")
    time.sleep(float(extra.get("sleep_s", 0)))
    return exact_match(sample)


def with_message_bodies(value: bytes) -> list[bytes]:
    """`value` plus every kombu message body found inside it, decoded.

    kombu stores message bodies (tasks, events, `unacked` entries) base64-encoded inside a JSON
    envelope, so a byte search of the raw value alone would miss what a message carries.
    """
    import base64

    found = [value]
    try:
        stack = [json.loads(value)]
    except (ValueError, UnicodeDecodeError):
        return found
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            body, props = item.get("body"), item.get("properties")
            if isinstance(body, str) and isinstance(props, dict):
                if props.get("body_encoding") == "base64":
                    found += with_message_bodies(base64.b64decode(body))
                else:
                    found += with_message_bodies(body.encode())
            stack += item.values()
        elif isinstance(item, list):
            stack += item
    return found


# --- Helpers for test_routes, test_cache, test_recovery ---


def write_route_config(
    directory: Path,
    backends: dict[str, dict],
    redis_url: str | None = None,
    routes: dict[str, dict] | None = None,
    **defaults,
) -> Path:
    """Like write_config, but each route is a table: {"backends": [...], "cache": True,
    "cache_ttl_s": 60, "weights": {"a": 1, "b": 3}} (every key but "backends" optional)."""
    path = write_config(directory, backends, redis_url, None, **defaults)
    lines = []
    for name, table in (routes or {}).items():
        lines.append(f"[routes.{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in table.items() if k != "weights"]
        if "weights" in table:
            lines.append(f"[routes.{name}.weights]")
            lines += [f"{k} = {toml_value(v)}" for k, v in table["weights"].items()]
    with path.open("a") as fh:
        fh.write("\n".join(lines) + "\n")
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_workers(config: Path, specs: list[tuple]) -> list[Worker]:
    """Start one Worker per (backend, name[, extra_env]) at the same time (each takes ~3 s)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [
            pool.submit(Worker, config, spec[0], spec[1], extra_env=(spec[2:] or [None])[0])
            for spec in specs
        ]
    workers, errors = [], []
    for future in futures:
        try:
            workers.append(future.result())
        except Exception as exc:  # stop the ones that did start before failing the test
            errors.append(exc)
    if errors:
        for worker in workers:
            worker.kill()
        raise errors[0]
    return workers


def tasks_received(worker: Worker) -> int:
    """How many task messages this worker has taken from its queue so far (from its log)."""
    return worker.log.read_text().count("] received")


def expected(app, backend: str, sample: dict) -> float:
    """The mock judge's verdict on what `backend` sends it for `sample`."""
    from qreward_queue.backends.judge import JudgeBackend
    from qreward_queue.testing.mock_judge import verdict

    return verdict(JudgeBackend(app.backend_config(backend)).render(sample))


def close_half_closed_channel(url: str, queue_name: str, **transport_options) -> None:
    """Leave one unacknowledged message in a kombu channel, put the channel in the state a
    lost Redis leaves it in when Celery's Connection.collect() is cut short (pools dropped,
    the transport's client gone, the channel not yet closed), then close it (see kombu_fix)."""
    from kombu import Connection, Queue

    import qreward_queue.broker.app  # noqa: F401  (installs kombu_fix, as every qrq process does)

    with Connection(url, transport_options=transport_options) as conn:
        channel = conn.default_channel
        queue = Queue(queue_name, routing_key=queue_name)(channel)
        queue.declare()
        conn.Producer(channel).publish({"n": 1}, routing_key=queue_name, serializer="json")
        assert queue.get(no_ack=False).payload == {"n": 1}
        channel._disconnect_pools()
        conn.transport.client = None
        channel.close()


class PrivateRedis:
    """`redis-server` on its own port, without RDB or AOF: a restart loses everything."""

    def __init__(self, directory: Path, port: int | None = None):
        self.directory, self.port = directory, port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> PrivateRedis:
        log = (self.directory / f"redis-{self.port}.log").open("a")
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(self.directory)],
            stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)

        def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, "redis-server exited"
            with contextlib.suppress(redis.ConnectionError):
                return bool(client.ping())
            return False

        wait_for(up, timeout_s=10, what=f"redis-server on port {self.port}")
        client.close()
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash would (nothing is saved: there is nothing to save to)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def reply(grant: Grant, status: int | None, headers: dict[str, str] | None = None,
          timed_out: bool = False, tokens: int | None = None) -> Reading:
    """End the call of `grant` as the worker does: released with what its HTTP reply taught,
    read as the HTTP kinds read one (`Feedback.from_http`)."""
    return grant.release(Feedback.from_http(status, headers, timed_out, tokens=tokens))


def call(limiter: Limiter, status: int | None, headers: dict[str, str] | None = None,
         timed_out: bool = False) -> Reading:
    """One call that comes back with `status`: booked (its wait not slept: what the reply
    does is what is looked at), then ended with its reply."""
    (grant,) = limiter.reserve(1)
    return reply(grant, status, headers, timed_out)


def start_gateway(stack, config: Path, *args: str, env: dict | None = None) -> tuple[str, Path]:
    """`qrq gateway` for `config` on a free port, as a user starts it (its log beside the
    config); returns its URL and log once /health answers in distributed mode."""
    port = free_port()
    log = config.parent / f"gateway-{port}.log"
    with log.open("w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "qreward_queue.cli", "gateway", "--port", str(port), *args],
            stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
            env={**os.environ, "QRQ_CONFIG": str(config), **(env or {})})
    stack.callback(lambda: (proc.terminate(), proc.wait(10)))
    url = f"http://127.0.0.1:{port}"

    def healthy():
        assert proc.poll() is None, log.read_text()
        try:
            return requests.get(url + "/health", timeout=1).json()
        except requests.ConnectionError:
            return None

    assert wait_for(healthy, 30, "the gateway's /health")["mode"] == "distributed"
    return url, log
