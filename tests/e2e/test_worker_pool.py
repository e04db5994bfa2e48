"""`qrq worker` runs the pool its backend file describes: queue, pool type, concurrency and
Celery's per-worker rate_limit."""

from __future__ import annotations

from support import Worker, judge_backend, write_config

import qreward_queue as qrq


def test_worker_takes_queue_pool_and_rate_limit_from_its_file(tmp_path, redis_url):
    backend = judge_backend("http://127.0.0.1:9", concurrency=3)
    backend["pool"]["rate_limit"] = "7/s"
    config_path = write_config(tmp_path, {"ja": backend}, redis_url=redis_url, route="ja")
    app = qrq.configure(qrq.load_config(config_path))
    with Worker(config_path, "ja", name="ja-pool@test"):
        inspect = app.control.inspect(destination=["ja-pool@test"], timeout=5)
        registered = inspect.registered("rate_limit")["ja-pool@test"]
        stats = inspect.stats()["ja-pool@test"]
        queues = inspect.active_queues()["ja-pool@test"]
    assert "qrq.score_chunk [rate_limit=7/s]" in registered
    assert stats["pool"]["max-concurrency"] == 3
    assert "Thread" in stats["pool"]["implementation"] or "thread" in str(stats["pool"])
    assert [q["name"] for q in queues] == ["qrq.ja"]
