"""A frozen Sentinel primary mid-batch: the primary is SIGSTOPped (a hung host keeps its
sockets open and answers nothing), the sentinels promote the replica, and later the old
primary is SIGCONTed and demoted. Used by tests/e2e/test_failover.py (which asserts the bounds)
and by benchmarks/sentinel_freeze.py (which prints the figures).

"First sample through the new primary": the batch has more outcomes than the judge had
received requests when the sentinels announced the promotion plus every sample the workers
can hold in tasks taken before (HELD), so a sample of a task taken from the new primary, and
called after the promotion, is scored.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import redis
from sentinel_cluster import SERVICE, PromotionWatch, SentinelCluster
from support import expected, judge_backend, start_workers, wait_for, write_config

import qreward_queue
from qreward_queue.broker.app import REDIS_READ_TIMEOUT_S
from qreward_queue.config.redis_conn import check_redis
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn

SAMPLES = 2000
RPM = 4800  # 80 requests/s: the batch lasts ~25 s, the freeze falls in its middle
WORKERS, CONCURRENCY, CHUNK = 2, 8, 4
HELD = WORKERS * CONCURRENCY * CHUNK  # samples in the tasks workers hold (prefetch 1, acks late)
PROBE = "qrq-test-probe"
# A command sent just before the freeze is answered by a primary thawed within the socket
# timeout (asynchronous replication's window, see the hardening docs): thawed after that.
THAW_AFTER_S = REDIS_READ_TIMEOUT_S + 3.0


class JudgeTimeline:
    """The judge's own request counters, sampled every 50 ms from a thread."""

    def __init__(self, judge):
        self.judge, self.points, self._stop = judge, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            stats = self.judge.stats()
            self.points.append((time.monotonic(), stats["requests"], stats["rate_limited"]))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, t: float) -> tuple[int, int]:
        """(requests, 429s) the judge had counted at time `t`."""
        before = [(r, q) for when, r, q in self.points if when <= t]
        return before[-1] if before else (0, 0)


def run_freeze(directory: Path, hold_s: float = 20.0, samples: int = SAMPLES,
               thaw_early: bool = True) -> dict:
    """Freeze the primary once a third of `samples` is scored; thaw it once a sample is scored
    through the new primary (`hold_s` after the promotion without one), not before THAW_AFTER_S
    from the freeze (`thaw_early` False: `hold_s` after the promotion in any case); the
    figures."""
    with contextlib.ExitStack() as stack:
        cluster = SentinelCluster(directory).start()
        stack.callback(cluster.stop)
        judge = stack.enter_context(
            spawn(MockJudgeSettings(latency_ms=20, latency_cv=0.2, rpm=RPM)))
        config_path = write_config(
            directory, {"j": judge_backend(judge.url, rpm=RPM, concurrency=CONCURRENCY,
                                           chunk_size=CHUNK)})
        with config_path.open("a") as fh:
            fh.write(f'[redis]\nurl = "{cluster.url}"\nservice_name = "{SERVICE}"\n')
        app = qreward_queue.configure(qreward_queue.load_config(config_path))
        check_redis(app.qrq_config)
        workers = start_workers(config_path, [("j", f"w{i}@freeze") for i in range(WORKERS)])
        for worker in workers:
            stack.callback(worker.kill)
        timeline = JudgeTimeline(judge)
        stack.callback(timeline.stop)
        items = [{"prompt": f"frozen question {i}", "response": f"answer {i}"}
                 for i in range(samples)]
        started = time.monotonic()
        batch = qreward_queue.submit_batch(items, route="j", app=app, deadline_s=150)
        wait_for(lambda: batch.completed >= samples // 3, timeout_s=60, what="a third")
        old_host, old_port = cluster.primary()
        watch = PromotionWatch(cluster)
        stack.callback(watch.stop)
        done_at_freeze, frozen = batch.completed, time.monotonic()
        cluster.freeze(old_port)
        stack.callback(cluster.thaw, old_port)
        promoted = watch.wait(30)
        calls_at_promotion = judge.stats()["requests"]
        first: float | None = None
        with contextlib.suppress(AssertionError):
            wait_for(lambda: batch.completed > calls_at_promotion + HELD,
                     timeout_s=max(0.0, promoted + hold_s - time.monotonic()))
            first = time.monotonic()
        thaw_at = frozen + THAW_AFTER_S if thaw_early else promoted + hold_s
        time.sleep(max(0.0, thaw_at - time.monotonic()))
        thawed = time.monotonic()
        cluster.thaw(old_port)
        active = _clients_until_demoted(old_host, old_port, time.time())
        outcomes = batch.outcomes()
        finished = time.monotonic()
        timeline.stop()
        statuses: dict[str, int] = {}
        for outcome in outcomes:
            status = "lost" if outcome is None else outcome.status
            statuses[status] = statuses.get(status, 0) + 1
        wrong = sum(o is not None and o.status == "ok" and o.score != expected(app, "j", s)
                    for s, o in zip(items, outcomes, strict=True))
        logs = "\n".join(w.log.read_text()[-3000:] for w in workers)
        return {
            "samples": samples,
            "done_at_freeze": done_at_freeze,
            "promotion_s": round(promoted - frozen, 2),
            "first_sample_after_promotion_s": None if first is None else round(first - promoted, 2),
            "held_s": round(thawed - frozen, 2),
            "statuses": statuses,
            "wrong_scores": wrong,
            "duplicates": judge.stats()["accepted"] - samples,
            "old_primary_served": active,
            "wall_s": round(finished - started, 1),
            "judge_calls_per_s": [  # from the freeze on
                timeline.at(frozen + t + 1)[0] - timeline.at(frozen + t)[0] for t in range(40)],
            "workers_alive": all(w.proc.poll() is None for w in workers),
            "worker_logs": logs,
        }


def _clients_until_demoted(host: str, port: int, thawed: float, timeout_s: float = 30.0
                           ) -> list[str]:
    """The connections to the old primary that ran a command after it was thawed and while it
    still said it was the primary (its sentinels', its replication link's and this probe's
    aside): whoever works on a demoted primary. Polled until it reports the replica role."""
    probe = redis.Redis(host=host, port=port, socket_timeout=1, client_name=PROBE)
    seen: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            time.sleep(0.2)
            with contextlib.suppress(redis.RedisError):
                clients = probe.client_list()
                if probe.execute_command("ROLE")[0] != b"master":
                    break
                since = time.time() - thawed
                for c in clients:
                    if _ours(c) or (int(c["idle"]) >= since - 1 and "b" not in c["flags"]):
                        continue
                    seen[c["addr"]] = f"{c['addr']} cmd={c['cmd']} flags={c['flags']}"
        else:
            raise AssertionError(f"the old primary was not demoted within {timeout_s:g} s")
    finally:
        probe.close()
    return sorted(seen.values())


def _ours(client: dict) -> bool:
    """The sentinels', the replication link's or the probe's own connection."""
    name = client.get("name", "")
    return (name == PROBE or name.startswith("sentinel-")
            or any(flag in client["flags"] for flag in "SM"))
