"""`qrq demo`: mock judges, a GRPO-like batch, qrq against a naive loop and an asyncio client."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..backends.judge import JudgeBackend, JudgeOptions
from ..config.model import Config
from ..errors import ConfigError
from ..samples import Outcome
from ..testing.mock_judge import MockJudgeProcess, MockJudgeSettings, spawn, verdict
from ..trainer.runtime import configure
from .demo_clients import SEMAPHORE, naive_score, semaphore_score

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


def port_taken(host: str, port: int) -> bool:
    """True when something already listens on host:port (binding it fails, with the
    SO_REUSEADDR the mock judge's server sets too, so a closed port in TIME_WAIT is free)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


@contextlib.contextmanager
def mock_judges(
    config: Config, names: list[str], echo: Callable[[str], None]
) -> Iterator[tuple[Config, list[MockJudgeProcess]]]:
    """One mock judge per backend, enforcing its limits, on the backend's port when it is
    free; otherwise (embedded mode) on a free port, with the backend's URL moved there.
    Yields the configuration the demo then runs on, and the judges."""
    with contextlib.ExitStack() as stack:
        judges, moved = [], {}
        for b in (config.backend(n) for n in names):
            own = b.options if isinstance(b.options, JudgeOptions) else None
            where = own.url if own else None
            url = urlsplit(where or "")
            if own is None or url.hostname not in ("127.0.0.1", "localhost"):
                raise ConfigError(
                    f"{b.source}: the demo needs local mock judges, "
                    f"but backend {b.name!r} is a {b.kind} at {where}"
                )
            port = url.port or 80
            if port_taken(url.hostname, port):
                if not config.embedded:  # worker processes read the port from the file
                    raise ConfigError(
                        f"{b.source}: port {port} of backend {b.name!r} is taken: stop what "
                        "listens there, or run the demo embedded (unset QRQ_REDIS_URL), "
                        "which picks free ports"
                    )
                port = 0
            settings = MockJudgeSettings(
                port=port,
                rpm=b.limits.rpm or 0,
                tpm=b.limits.tpm or 0,
                max_concurrent=b.limits.max_concurrent or 0,
                latency_ms=DEMO_LATENCY_MS,
                latency_cv=DEMO_LATENCY_CV,
            )
            try:
                judge = stack.enter_context(spawn(settings))
            except RuntimeError as exc:
                raise ConfigError(f"{b.source}: no mock judge on port {port}: {exc}") from None
            judges.append(judge)
            if port == 0:
                new_url = url._replace(netloc=urlsplit(judge.url).netloc).geturl()
                echo(f"port {url.port} of backend {b.name!r} is taken; its mock judge runs at "
                     f"{urlsplit(judge.url).netloc} instead")
                moved[b.name] = dataclasses.replace(
                    b, options=dataclasses.replace(own, url=new_url))
        yield dataclasses.replace(config, backends={**config.backends, **moved}), judges


@contextlib.contextmanager
def demo_workers(config: Config, names: list[str]):
    """In distributed mode, one `qrq worker` subprocess per backend of the route."""
    if config.embedded:
        yield
        return
    command = [sys.executable, "-m", "qreward_queue.cli", "worker", "--loglevel", "WARNING"]
    if config.source != "<memory>":
        command += ["--config", config.source]
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


def run_demo(
    config: Config, echo: Callable[[str], None], route: str | None = None, prompts: int = 128
) -> bool:
    """Run the three clients on the same judges; True when every score matched the rule."""
    the_route = config.route(route)
    names = list(the_route.backends)
    samples = grpo_batch(prompts)
    with mock_judges(config, names, echo) as (config, judges):
        app = configure(config)
        backends = [config.backend(n) for n in names]
        with demo_workers(config, names):
            echo(
                "mock judges: "
                + ", ".join(
                    f"{b.name} at {j.url} (rpm {b.limits.rpm:g}, "
                    f"{b.limits.max_concurrent} concurrent)"
                    for b, j in zip(backends, judges, strict=True)
                )
            )
            echo(
                f"scoring {len(samples)} samples ({prompts} prompts x 8 responses), judge latency "
                f"{DEMO_LATENCY_MS:g} ms mean; naive: one request at a time to {names[0]}; "
                f"asyncio: Semaphore({SEMAPHORE}) over {', '.join(names)}; qrq: route "
                f"{the_route.name!r}"
            )
            rows = []

            def plain(client: str, scores: list[float], wall: float, used: list[str]) -> None:
                want = expected_scores(config, samples, used)
                server_429 = sum(j.stats()["rate_limited"] for j in judges)
                rows.append(RunFigures(client, wall, server_429, _wrong(scores, want), 0,
                                       len(samples)))
                for j in judges:
                    j.reset()

            start = time.perf_counter()
            with progress_bar(len(samples), "naive loop") as advance:
                scores = naive_score(backends[0], samples, advance)
            plain("naive", scores, time.perf_counter() - start, [names[0]] * len(samples))

            start = time.perf_counter()
            scores = semaphore_score(backends, samples)
            used = [names[i % len(names)] for i in range(len(samples))]
            plain("asyncio", scores, time.perf_counter() - start, used)

            from ..trainer.client import submit_batch

            start = time.perf_counter()
            outcomes = submit_batch(samples, route=the_route.name, app=app).outcomes()
            wall = time.perf_counter() - start
            server_429 = sum(j.stats()["rate_limited"] for j in judges)
            rows.append(qrq_figures(config, samples, outcomes, wall, server_429))
    echo(f"{'client':<8}{'wall_s':>8}{'samples/s':>11}{'server_429':>12}{'wrong':>7}{'not_ok':>8}")
    for r in rows:
        echo(
            f"{r.client:<8}{r.wall_s:>8.2f}{r.per_s:>11.1f}{r.server_429:>12}{r.wrong:>7}"
            f"{r.not_ok:>8}"
        )
    ok = all(r.wrong == 0 and r.not_ok == 0 for r in rows)
    naive, asyncio_row, qrq = rows
    echo(
        f"qrq: {qrq.server_429} requests refused by the judges (429), the asyncio client "
        f"{asyncio_row.server_429}, the naive loop {naive.server_429}; "
        f"{naive.wall_s / qrq.wall_s:.1f}x the naive loop's speed, "
        f"{asyncio_row.wall_s / qrq.wall_s:.1f}x the asyncio client's; "
        + ("every score matches the judge's rule" if ok else "SOME SCORES ARE WRONG OR MISSING")
    )
    return ok


@contextlib.contextmanager
def progress_bar(total: int, what: str) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr while a slow client runs (none when stderr is no terminal, so
    the demo's printed report stays the same); yields `advance(done)`."""
    from tqdm import tqdm

    with tqdm(total=total, desc=what, unit="sample", file=sys.stderr, disable=None,
              leave=False, mininterval=0, miniters=1) as bar:  # ~35 samples/s: draw each
        yield lambda done: bar.update(done - bar.n)


def qrq_figures(
    config: Config, samples: list[dict], outcomes: list[Outcome], wall: float, server_429: int
) -> RunFigures:
    scored = [o for o in outcomes if o.scored]
    want = expected_scores(
        config,
        [s for s, o in zip(samples, outcomes, strict=True) if o.scored],
        [o.backend or "" for o in scored],
    )
    return RunFigures(
        "qrq",
        wall,
        server_429,
        _wrong([o.reward for o in scored], want),
        len(outcomes) - len(scored),
        len(samples),
    )


def _wrong(got: list[float], want: list[float]) -> int:
    return sum(abs(g - w) > 1e-9 for g, w in zip(got, want, strict=True))
