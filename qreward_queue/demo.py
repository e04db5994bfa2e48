"""`qrq demo`: mock judges, a GRPO-like batch, qrq against a naive sequential client."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import requests

from .backends.judge import JudgeBackend
from .config import Backend, Config
from .errors import ConfigError
from .mock_judge import MockJudgeSettings, spawn, verdict
from .runtime import configure
from .samples import Outcome

DEMO_LATENCY_MS = 25.0
DEMO_LATENCY_CV = 0.5


def grpo_batch(n_prompts: int = 128, group: int = 8) -> list[dict]:
    """`n_prompts` arithmetic prompts x `group` sampled responses, some right, some wrong."""
    samples = []
    for p in range(n_prompts):
        a, b = 17 + 7 * p, 3 + 11 * p
        for g in range(group):
            answer = a + b if g % 3 else a + b + g
            samples.append(
                {
                    "prompt": f"What is {a} + {b}?",
                    "response": f"Attempt {g}: {a} + {b} = {answer}. The answer is {answer}.",
                    "reference": str(a + b),
                    "data_source": "demo/arith",
                    "id": f"p{p}-g{g}",
                }
            )
    return samples


def naive_score(backend: Backend, samples: list[dict]) -> list[float]:
    """What a plain script does: one request after another, a fresh connection each time,
    sleeping Retry-After on 429 so that it still gets every score right."""
    judge = JudgeBackend(backend)
    endpoint = backend.url.rstrip("/") + "/chat/completions"
    scores = []
    for sample in samples:
        while True:
            reply = requests.post(
                endpoint,
                json={"model": backend.model, "messages": judge.messages(sample), "max_tokens": 16},
                timeout=backend.timeout_s,
            )
            if reply.status_code != 429:
                break
            time.sleep(float(reply.headers.get("retry-after", 1)))
        reply.raise_for_status()
        content = reply.json()["choices"][0]["message"]["content"]
        scores.append(float(judge.pattern.search(content).group(1)))
    return scores


@dataclass
class RunFigures:
    client: str
    wall_s: float
    server_429: int
    wrong: int
    not_ok: int
    n: int

    @property
    def per_s(self) -> float:
        return self.n / self.wall_s


def expected_scores(config: Config, samples: list[dict], backends: list[str]) -> list[float]:
    """The judge's rule applied to what each sample's backend sent it."""
    judges = {name: JudgeBackend(config.backend(name)) for name in set(backends)}
    return [verdict(judges[b].render(s)) for s, b in zip(samples, backends, strict=True)]


@contextlib.contextmanager
def mock_judges(backends: list[Backend]):
    """One mock judge per backend, on the backend's port, enforcing the backend's limits."""
    with contextlib.ExitStack() as stack:
        judges = []
        for b in backends:
            if b.kind != "judge" or urlsplit(b.url).hostname not in ("127.0.0.1", "localhost"):
                raise ConfigError(
                    f"{b.source}: the demo needs local mock judges, "
                    f"but backend {b.name!r} is a {b.kind} at {b.url}"
                )
            judges.append(
                stack.enter_context(
                    spawn(
                        MockJudgeSettings(
                            port=urlsplit(b.url).port or 80,
                            rpm=b.limits.rpm or 0,
                            tpm=b.limits.tpm or 0,
                            max_concurrent=b.limits.max_concurrent or 0,
                            latency_ms=DEMO_LATENCY_MS,
                            latency_cv=DEMO_LATENCY_CV,
                        )
                    )
                )
            )
        yield judges


@contextlib.contextmanager
def demo_workers(config: Config, names: list[str]):
    """In distributed mode, one `qrq worker` subprocess per backend of the route."""
    if config.embedded:
        yield
        return
    command = [sys.executable, "-m", "qreward_queue.cli", "worker", "--loglevel", "WARNING"]
    procs = [
        subprocess.Popen([*command, config.backend(n).source], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
        for n in names
    ]
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)


def run_demo(config: Config, echo: Callable[[str], None], route: str | None = None) -> bool:
    """Run both clients on the same judges; True when every score matched the judge's rule."""
    app = configure(config)
    the_route = config.route(route)
    backends = [config.backend(n) for n in the_route.backends]
    samples = grpo_batch()
    with mock_judges(backends) as judges, demo_workers(config, list(the_route.backends)):
        echo(
            "mock judges: "
            + ", ".join(
                f"{b.name} at {j.url} (rpm {b.limits.rpm:g}, {b.limits.max_concurrent} concurrent)"
                for b, j in zip(backends, judges, strict=True)
            )
        )
        echo(
            f"scoring {len(samples)} samples (128 prompts x 8 responses), "
            f"judge latency {DEMO_LATENCY_MS:g} ms mean"
        )
        rows = []

        def server_429() -> int:
            return sum(j.stats()["rate_limited"] for j in judges)

        start = time.perf_counter()
        scores = naive_score(backends[0], samples)
        wall = time.perf_counter() - start
        want = expected_scores(config, samples, [backends[0].name] * len(samples))
        rows.append(RunFigures("naive", wall, server_429(), _wrong(scores, want), 0, len(samples)))
        for j in judges:
            j.reset()

        from .client import submit_batch

        start = time.perf_counter()
        outcomes = submit_batch(samples, route=the_route.name, app=app).outcomes()
        wall = time.perf_counter() - start
        rows.append(qrq_figures(config, samples, outcomes, wall, server_429()))
    echo(f"{'client':<8}{'wall_s':>8}{'samples/s':>11}{'server_429':>12}{'wrong':>7}{'not_ok':>8}")
    for r in rows:
        echo(
            f"{r.client:<8}{r.wall_s:>8.2f}{r.per_s:>11.1f}{r.server_429:>12}{r.wrong:>7}"
            f"{r.not_ok:>8}"
        )
    ok = all(r.wrong == 0 and r.not_ok == 0 for r in rows)
    echo(
        f"speedup: {rows[0].wall_s / rows[1].wall_s:.1f}x; "
        + ("every score matches the judge's rule" if ok else "SOME SCORES ARE WRONG OR MISSING")
    )
    return ok


def qrq_figures(
    config: Config, samples: list[dict], outcomes: list[Outcome], wall: float, server_429: int
) -> RunFigures:
    scored = [o for o in outcomes if o.scored]
    want = expected_scores(
        config,
        [s for s, o in zip(samples, outcomes, strict=True) if o.scored],
        [o.backend for o in scored],
    )
    return RunFigures(
        "qrq",
        wall,
        server_429,
        _wrong([o.score for o in scored], want),
        len(outcomes) - len(scored),
        len(samples),
    )


def _wrong(got: list[float], want: list[float]) -> int:
    return sum(abs(g - w) > 1e-9 for g, w in zip(got, want, strict=True))
