"""A real Sentinel group on loopback: a primary, one replica and three `redis-sentinel`s.

Each process runs on a free port of its own with its files in a temp directory; `stop()`
kills whatever still runs. Failure detection is short (1 s down-after, quorum 2) so a test
sees a failover within seconds.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from pathlib import Path

import redis
from support import free_port, wait_for

SERVICE = "qrq-primary"
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 3000


class SentinelCluster:
    def __init__(self, directory: Path, sentinels: int = 3):
        self.directory = directory
        self.primary_port, self.replica_port = free_port(), free_port()
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        """Celery's form: every sentinel, the database on each."""
        return ";".join(f"sentinel://127.0.0.1:{p}/0" for p in self.sentinel_ports)

    def _spawn(self, port: int, cmd: list[str]) -> None:
        with (self.directory / f"redis-{port}.log").open("a") as log:
            self.procs[port] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def _server(self, port: int, *extra: str) -> None:
        work = self.directory / f"data-{port}"
        work.mkdir(exist_ok=True)
        self._spawn(port, ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                           "--save", "", "--appendonly", "no", "--dir", str(work), *extra])

    def start(self) -> SentinelCluster:
        self._server(self.primary_port)
        self._server(self.replica_port, "--replicaof", "127.0.0.1", str(self.primary_port))
        replica = redis.Redis(port=self.replica_port, socket_connect_timeout=0.5)
        wait_for(lambda: _quiet(lambda: replica.info("replication")["master_link_status"] == "up"),
                 timeout_s=15, what="the replica in sync")
        for port in self.sentinel_ports:
            conf = self.directory / f"sentinel-{port}.conf"
            conf.write_text("\n".join([
                f"port {port}", "bind 127.0.0.1", f"dir {self.directory}",
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary_port} 2",
                f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}",
                f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}",
                f"sentinel parallel-syncs {SERVICE} 1", "",
            ]))
            self._spawn(port, ["redis-sentinel", str(conf)])
        for port in self.sentinel_ports:
            node = redis.Redis(port=port, socket_connect_timeout=0.5)
            # every sentinel knows the replica and the other sentinels before anything fails
            wait_for(lambda n=node: _quiet(lambda: _ready(n, len(self.sentinel_ports))),
                     timeout_s=20, what=f"sentinel {port} ready")
        return self

    def primary(self) -> tuple[str, int]:
        """The primary the sentinels name now."""
        node = redis.Redis(port=self.sentinel_ports[0], socket_connect_timeout=0.5)
        host, port = node.sentinel_get_master_addr_by_name(SERVICE)
        return host.decode() if isinstance(host, bytes) else host, int(port)

    def freeze(self, port: int) -> None:
        """SIGSTOP: the process holds its sockets open and answers nothing (a hung host)."""
        self.procs[port].send_signal(signal.SIGSTOP)

    def thaw(self, port: int) -> None:
        self.procs[port].send_signal(signal.SIGCONT)

    def kill(self, port: int) -> None:
        proc = self.procs[port]
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def stop(self) -> None:
        for port in list(self.procs):
            self.kill(port)


class PromotionWatch:
    """When the sentinels announced a new primary (`+switch-master`), on the monotonic clock."""

    def __init__(self, cluster: SentinelCluster):
        self.at: float | None = None
        self._seen = threading.Event()
        self._pubsub = redis.Redis(port=cluster.sentinel_ports[0]).pubsub()
        self._pubsub.subscribe(**{"+switch-master": self._on_switch})
        self._thread = self._pubsub.run_in_thread(sleep_time=0.05, daemon=True)

    def _on_switch(self, message: dict) -> None:
        if self.at is None:
            self.at = time.monotonic()
        self._seen.set()

    def wait(self, timeout_s: float) -> float:
        if not self._seen.wait(timeout_s):
            raise AssertionError(f"no +switch-master within {timeout_s:g} s")
        assert self.at is not None
        return self.at

    def stop(self) -> None:
        self._thread.stop()
        self._thread.join(5)
        self._pubsub.close()


def _ready(node: redis.Redis, sentinels: int) -> bool:
    state = node.sentinel_master(SERVICE)
    return state["num-slaves"] >= 1 and state["num-other-sentinels"] >= sentinels - 1


def _quiet(check) -> bool:
    with contextlib.suppress(redis.RedisError, KeyError):
        return bool(check())
    return False
