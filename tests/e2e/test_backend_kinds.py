"""A backend kind is one class with its options dataclass, plus one line in `backends.KINDS`:
adding one touches nothing else.

The kind below exists only in this file: a batched scorer on its own transport (a stand-in for
a gRPC reward model) that takes 4 samples per call and declares options of its own. The
loader reads and checks its keys by the dataclass's fields, `qrq worker` runs its pre-flight
check, the planner and `qrq plan` count its calls, the chunker never cuts a call in two, the
cache keys its scores by its own identity, and a real `qrq worker` (which registers it the
same way) scores with it over real Redis.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import redis
from click.testing import CliRunner
from support import Worker, toml_tables, write_route_config

import qreward_queue
from qreward_queue import backends
from qreward_queue.backends import (
    BackendClient,
    Call,
    JudgeOptions,
    RewardModelOptions,
    make_backend,
)
from qreward_queue.backends.judge import JudgeBackend
from qreward_queue.backends.reward_model import RewardModelBackend
from qreward_queue.broker.cache import reward_identity
from qreward_queue.cli.main import cli
from qreward_queue.config.loader import load_backend, load_config
from qreward_queue.config.model import Backend, KindOptions
from qreward_queue.errors import ConfigError, RateLimited
from qreward_queue.ops.plan import Workload, plan_route
from qreward_queue.planning.routing import chunk_size, plan

HERE = Path(__file__).resolve().parent  # this file, and the tests' shared modules above it
PER_CALL = 4
CALLS_KEY = "test:quad:calls"  # each call's size, pushed by the kind (in this test's database)


@dataclass(frozen=True, kw_only=True)
class QuadOptions(KindOptions):
    """The stand-in kind's own keys of `[backend]`."""

    scale: float = 1.0  # the score is len(response) x scale / 100
    record_url: str | None = None  # a Redis the kind pushes each call's size to
    needs: str | None = None  # an environment variable a worker must have to start


class QuadBackend(BackendClient):
    """Scores len(response) x `scale` / 100, 4 samples per call; records each call's size."""

    Options: ClassVar[type[KindOptions]] = QuadOptions

    def __init__(self, config: Backend):
        super().__init__(config)
        self.options = config.options_as(QuadOptions)

    def preflight(self) -> list[str]:
        if self.options.needs and self.options.needs not in os.environ:
            raise ConfigError(f"{self.config.source}: quad needs ${self.options.needs}")
        return [*super().preflight(), f"quad at scale {self.options.scale:g}"]

    @property
    def samples_per_call(self) -> int:
        return PER_CALL

    def identity(self) -> list[Any]:
        return [*super().identity(), self.options.scale]

    def call(self, samples: list[dict]) -> Call:
        if self.options.record_url:
            with redis.Redis.from_url(self.options.record_url) as store:
                store.rpush(CALLS_KEY, len(samples))
        return Call([quad_score(self.options, s) for s in samples])


def quad_score(options: QuadOptions, sample: dict) -> float:
    return len(sample["response"]) * options.scale / 100


def register() -> None:
    """What adding the kind to `backends.KINDS` does (here for this test and its worker)."""
    backends.KINDS["quad"] = QuadBackend


@pytest.fixture
def quad_kind(monkeypatch):
    monkeypatch.setitem(backends.KINDS, "quad", QuadBackend)


def quad_tables(**options) -> dict:
    return {
        "backend": {"kind": "quad", "timeout_s": 10, **options},
        "limits": {"max_concurrent": 16},
        "pool": {"concurrency": 1, "calls": 6},  # a round of calls: 6 samples, not whole calls
    }


def quad_config(directory: Path, redis_url: str | None = None, **options) -> Path:
    return write_route_config(directory, {"q": quad_tables(**options)}, redis_url=redis_url,
                              routes={"quad": {"backends": ["q"], "cache": True}})


def samples_for(n: int, tag: str) -> list[dict]:
    return [{"prompt": f"{tag} {i}", "response": "x" * (i + 1)} for i in range(n)]


# --------------------------------------------------------------------------------------------
# The kind's facts, asked by the loader, the chunker, the planner and the cache


def test_the_loader_asks_the_kind_for_its_keys(tmp_path, quad_kind):
    path = tmp_path / "q.toml"
    path.write_text(toml_tables(quad_tables(scale=2.0)))
    backend = load_backend(path)
    assert backend.kind == "quad" and backend.options == QuadOptions(scale=2.0)
    assert backend.pool.type == "threads" and not backend.pool.sized  # not a local kind
    path.write_text(toml_tables(quad_tables(scale="big", colour="red")))
    with pytest.raises(ConfigError, match=r"q\.toml: backend\.scale: expected a number, got "
                                          r"'big'; backend\.colour: unknown key"):
        load_backend(path)
    unknown = qreward_queue.Config(None, {"g": Backend("g", "grpc")}, {})
    with pytest.raises(ConfigError, match=r"<memory>: backend 'g': unknown kind 'grpc' "
                                          r"\(known: judge, reward_model, function, quad\)"):
        plan(unknown, unknown.route("g"), [0, 1])  # no silent fallback to another kind's facts
    path.write_text(toml_tables({"backend": {"kind": "grpc"}}))
    with pytest.raises(ConfigError, match=r"backend\.kind: expected one of judge, "
                                          r"reward_model, function, quad, got 'grpc'"):
        load_backend(path)


@pytest.mark.parametrize("n", [1, 5, 13, 50, 100, 1000, 4096])
def test_chunks_are_whole_calls(n, quad_kind):
    backend = Backend("q", "quad", options=QuadOptions())
    assert make_backend(backend).split(samples_for(10, "s")) == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                                 [8, 9]]
    assert chunk_size(backend, n) % PER_CALL == 0
    config = qreward_queue.Config(redis_url=None, backends={"q": backend}, routes={})
    chunks = plan(config, config.route("q"), list(range(n)))
    assert all(len(c.indices) % PER_CALL == 0 for c in chunks[:-1])
    assert sum(len(c.indices) for c in chunks) == n


def test_qrq_plan_counts_the_kinds_calls(tmp_path, quad_kind):
    config = load_config(quad_config(tmp_path))
    p = plan_route(config, "quad", Workload(n=1000, latency_s=0.5))
    (q,) = p.backends
    assert (q.samples_per_call, q.calls) == (PER_CALL, 250)
    # 6 calls in flight per worker, 0.5 s each: 12 calls/s, 4 samples each
    assert q.binding == "worker calls" and q.rates["worker calls"] == 12.0
    out = CliRunner().invoke(cli, ["plan", "--config", str(tmp_path / "qrq.toml"), "--route",
                                   "quad", "-n", "1000", "--latency-ms", "500"])
    assert out.exit_code == 0, out.output
    assert f"q{' ' * 15}{1000:>8}{250:>7}{12.0:>9.1f}" in out.output


def test_the_cache_keys_scores_by_the_kinds_identity(tmp_path, quad_kind):
    def identity(scale: float, directory: str) -> str:
        config = load_config(quad_config(tmp_path / directory, scale=scale))
        return reward_identity(config, config.route("quad"))

    assert identity(1.0, "a") == identity(1.0, "b")
    assert identity(1.0, "a") != identity(2.0, "c")  # an option the scores depend on


def test_a_worker_runs_the_kinds_preflight_before_it_starts(tmp_path, redis_url, quad_kind,
                                                          monkeypatch):
    monkeypatch.delenv("QRQ_TEST_QUAD_NEEDS", raising=False)
    config_path = quad_config(tmp_path, redis_url, needs="QRQ_TEST_QUAD_NEEDS")
    out = CliRunner().invoke(cli, ["worker", str(tmp_path / "workers" / "q.toml"), "--config",
                                   str(config_path)], prog_name="qrq")
    assert out.exit_code == 2
    assert out.stderr.strip() == (f"qrq: error: {tmp_path / 'workers' / 'q.toml'}: "
                                  "quad needs $QRQ_TEST_QUAD_NEEDS")


def test_http_kinds_teach_the_limiter_what_their_replies_say():
    judge = JudgeBackend(Backend("j", "judge", options=JudgeOptions(url="http://127.0.0.1:1/v1",
                                 model="m")))
    throttled = RateLimited("rate limited (429)", status_code=429,
                            headers={"retry-after": "3", "x-ratelimit-remaining-requests": "0"})
    told = judge.feedback(throttled)
    assert told.rate_limited and not told.answered and told.told.pause_s() == 3.0
    ok = RewardModelBackend(Backend("r", "reward_model",
                                    options=RewardModelOptions(url="http://127.0.0.1:1")))
    learned = ok.feedback(Call([1.0], 42, 200, {"x-ratelimit-limit-requests": "600"}))
    assert learned.answered and learned.tokens == 42 and learned.told.limit_requests == 600
    silent = QuadBackend(Backend("q", "quad", options=QuadOptions())).feedback(Call([1.0]))
    assert not (silent.answered or silent.rate_limited or silent.timed_out)
    assert silent.tokens is None and silent.told.limit_requests is None


# --------------------------------------------------------------------------------------------
# End to end: a real worker that registers the kind, real Redis


def test_a_real_worker_scores_with_the_new_kind(tmp_path, redis_url, redis_client, stack,
                                                quad_kind):
    # Given a cached route on a quad backend and a worker that knows the kind
    config_path = quad_config(tmp_path, redis_url, scale=2.0, record_url=redis_url)
    launcher = ("-c", f"import sys; sys.path[:0] = [{str(HERE)!r}, {str(HERE.parent)!r}]; "
                "import test_backend_kinds as t; t.register(); "
                "from qreward_queue.cli.main import main; sys.argv[0] = 'qrq'; main()")
    worker = Worker(config_path, "q", launcher=launcher)
    stack.callback(worker.kill)
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    backend = app.backend_config("q")
    samples = samples_for(50, "e2e")

    # When 50 samples are scored
    outcomes = qreward_queue.submit_batch(samples, route="quad", app=app,
                                          deadline_s=60).outcomes(timeout=30)

    # Then each has the kind's score, and every call took 4 samples but the batch's last
    assert [o.status for o in outcomes] == ["ok"] * 50
    assert [o.score for o in outcomes] == [quad_score(backend.options, s) for s in samples]
    sizes = sorted(int(v) for v in redis_client.lrange(CALLS_KEY, 0, -1))
    assert sizes == [50 % PER_CALL] + [PER_CALL] * math.floor(50 / PER_CALL)
    assert "qrq: quad at scale 2\n" in worker.log.read_text()  # its preflight's line
    # and the same samples again come from the cache, with no call made
    again = qreward_queue.submit_batch(samples, route="quad", app=app).outcomes(timeout=5)
    assert [o.status for o in again] == ["cached"] * 50
    assert [o.score for o in again] == [o.score for o in outcomes]
    assert redis_client.llen(CALLS_KEY) == len(sizes)
