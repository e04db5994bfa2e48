"""qrq: init, demo, score, worker, status, plan, exporter, gateway, audit, dead-letters,
mock-judge. One-line errors.

Exit status: 0 success; 2 nothing could run (usage, configuration, Redis unreachable); for
`qrq score` also 1 when some samples were not scored and 3 when none was.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import click
import redis
from kombu.exceptions import OperationalError

from ..config.extras import missing_extra
from ..config.loader import find_config, load_config
from ..config.model import PACKAGED_CONFIG, Config, config_not_found
from ..config.redis_conn import check_redis, describe_mode, redis_problem
from ..errors import Cancelled, ConfigError, QrqError
from ..ops.metrics_http import TOKEN_ENV
from ..priority import Priority
from ..samples import Outcome
from ..testing.mock_judge import mock_judge_cli

EXIT_SOME_NOT_SCORED, EXIT_USAGE, EXIT_NONE_SCORED = 1, 2, 3
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT
_CONFIG_META = "qrq.config"


class _Group(click.Group):
    """Turns qrq's own errors, a missing optional dependency, and Redis going away mid-command
    into one `qrq: error:` line."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except QrqError as exc:
            click.echo(f"qrq: error: {exc}", err=True)
            ctx.exit(EXIT_USAGE)
        except (redis.RedisError, OperationalError) as exc:
            config = ctx.meta.get(_CONFIG_META)
            if config is None or config.embedded:
                raise
            click.echo(f"qrq: error: {redis_problem(config, exc)}", err=True)
            ctx.exit(EXIT_USAGE)
        except ImportError as exc:
            line = missing_extra(exc, f"qrq {ctx.invoked_subcommand}")
            if line is None:
                raise
            click.echo(f"qrq: error: {line}", err=True)
            ctx.exit(EXIT_USAGE)


def _load(
    config_path: str | None, *, fallback: Path | None = None, required: bool = True
) -> Config:
    """The configuration a command runs on, with its Redis checked (distributed mode).

    Without a file from the default lookup, `fallback` is used; with none either, a `required`
    file is an error saying where qrq looked.
    """
    path = config_path or find_config() or fallback
    if path is None and required:
        raise ConfigError(config_not_found())
    config = load_config(path)
    click.get_current_context().meta[_CONFIG_META] = config
    check_redis(config)
    return config


@click.group(cls=_Group)
@click.version_option(package_name="qreward-queue", prog_name="qrq")
def cli() -> None:
    """qreward-queue: score RL rewards fast under the rate limits of the services behind them."""


cli.add_command(mock_judge_cli)
config_option = click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    envvar="QRQ_CONFIG",
    help="qrq.toml (default: $QRQ_CONFIG, ./qrq.toml)",
)


@cli.command()
@click.option("--judge-url", required=True, prompt="Judge base URL (OpenAI-compatible, e.g. "
              "http://127.0.0.1:8000/v1)", help="The judge's OpenAI-compatible base URL.")
@click.option("--model", required=True, prompt="Model name the judge serves",
              help="The model name sent in each request.")
@click.option("--name", default="judge", show_default=True,
              help="The backend's (and the route's) name.")
@click.option("--api-key-env", metavar="VAR",
              help="The NAME of the environment variable holding the judge's API key.")
@click.option("--rpm", type=click.FloatRange(min=0, min_open=True),
              help="The judge's requests per minute.")
@click.option("--max-concurrent", type=click.IntRange(1), help="The judge's calls at once.")
@click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path),
              default=Path("."), show_default=True, help="Where to write the files.")
def init(judge_url: str, model: str, name: str, api_key_env: str | None, rpm: float | None,
         max_concurrent: int | None, directory: Path) -> None:
    """Write a commented qrq.toml and workers/NAME.toml for your own judge (never over a file
    that exists)."""
    from .init_config import JudgeSpec, write_starter

    spec = JudgeSpec(judge_url, model, name, api_key_env, rpm, max_concurrent)
    for path in write_starter(spec, directory):
        click.echo(f"wrote {path}")
    click.echo(f"next: qrq score IN.jsonl -o OUT.jsonl --config {directory / 'qrq.toml'} "
               f"(embedded), or with QRQ_REDIS_URL set: qrq worker "
               f"{directory / 'workers' / f'{name}.toml'}")


@cli.command()
@config_option
@click.option("--route", help="Route to score on (default: the config's default route).")
@click.option(
    "--prompts", type=click.IntRange(1), default=128, show_default=True,
    help="GRPO prompts in the batch (8 responses each).",
)
def demo(config_path: str | None, route: str | None, prompts: int) -> None:
    """Start mock judges and score a 1,024-sample GRPO batch: qrq vs two plain clients."""
    from ..trainer.runtime import shutdown
    from .demo import run_demo

    config = _load(config_path, fallback=PACKAGED_CONFIG)
    click.echo(describe_mode(config))
    if config.source == str(PACKAGED_CONFIG):
        click.echo(f"config: the example shipped with qrq ({PACKAGED_CONFIG})")
    try:
        ok = run_demo(config, click.echo, route, prompts)
    finally:
        shutdown()
    if not ok:
        sys.exit(1)


@cli.command()
@click.argument("input_file", metavar="IN.jsonl", type=click.File("rb"))
@click.option(
    "-o",
    "--output",
    type=click.File("w", encoding="utf-8"),
    default="-",
    help="Where to write one outcome per line (default: stdout).",
)
@click.option("--route", help="Route to score on (default: the config's default route).")
@click.option(
    "--priority", type=click.Choice([p.value for p in Priority]), default=Priority.BULK.value,
    show_default=True,
    help="val is served before train, train before bulk.",
)
@click.option("--deadline-s", type=float, help="Return by then; the rest comes back as timeout.")
@config_option
def score(input_file, output, route, priority, deadline_s, config_path) -> None:
    """Score the samples in IN.jsonl, in order: one JSON object per line, with "prompt" and
    "response" (strings) and optionally "reference", "data_source" (strings), "extra" (an
    object) and "id" (carried back on the outcome).

    Exit status: 0 every sample scored (ok or cached), 1 some were not (error, timeout), 3 none
    was, 2 nothing ran (usage, configuration, Redis unreachable), 130 interrupted (Ctrl-C: what
    was scored is written, the rest as cancelled, and no further judge call is made).
    """
    from tqdm import tqdm

    from ..trainer.client import submit_batch
    from ..trainer.runtime import configure, shutdown

    config = _load(config_path)
    samples: list = []
    lines: list[int] = []
    unreadable: dict[int, str] = {}
    batch = None
    bar = None
    interrupted = False
    try:
        try:  # Ctrl-C anywhere in here: what was published is cancelled, every line written
            click.echo(describe_mode(config), err=True)
            app = configure(config)
            read_jsonl(input_file, samples, lines, unreadable)
            batch = submit_batch(samples, route, priority, deadline_s, on_invalid="outcome",
                                 app=app)  # interrupted inside, it cancels what it published
            bar = tqdm(total=len(batch), unit="sample", file=sys.stderr, disable=None)
            while not batch.done() and time.time() < batch.deadline:
                bar.update(batch.completed - bar.n)
                time.sleep(0.2)
        except KeyboardInterrupt:
            interrupted = True
            if batch is not None:
                batch.cancel()
        outcomes = batch.outcomes() if batch is not None else unsubmitted(samples, config)
        if bar is not None:
            settle_bar(bar, outcomes)
        # written before the embedded worker stops: its shutdown waits for a call in flight,
        # and the outcomes are due at the deadline, not after that call
        write_outcomes(output, outcomes, lines, unreadable)
    finally:
        if bar is not None:
            bar.close()
        shutdown()
    summary, code = summarize(outcomes)
    click.echo(summary, err=True)
    sys.exit(EXIT_INTERRUPTED if interrupted else code)


def settle_bar(bar, outcomes: list) -> None:
    """The progress bar's last state: samples done (cancelled and timed-out ones are not),
    with the count of each status, so a Ctrl-C shows as cancelled samples, not as progress."""
    counts = Counter(o.status for o in outcomes)
    bar.n = len(outcomes) - counts["cancelled"] - counts["timeout"]
    bar.set_description("cancelled" if counts["cancelled"] else "done", refresh=False)
    bar.set_postfix_str(", ".join(f"{v} {k}" for k, v in sorted(counts.items())), refresh=False)
    bar.refresh()


def unsubmitted(samples: list, config: Config) -> list:
    """The outcomes of samples a Ctrl-C kept from being submitted: each `cancelled`."""
    why = Outcome.failed(Cancelled("interrupted before it was submitted"))
    return [why.placed(s.get("id") if isinstance(s, dict) else None, config.fallback_score)
            for s in samples]


def write_outcomes(output, outcomes: list, lines: list[int], unreadable: dict[int, str]) -> None:
    """One JSON line per outcome, in input order, naming the input line of each."""
    for index, outcome in enumerate(outcomes):
        if index in unreadable:
            outcome.error = unreadable[index]
        elif outcome.error and outcome.error.startswith("invalid sample"):
            outcome.error = f"line {lines[index]}: {outcome.error}"
        output.write(json.dumps({"index": index, "line": lines[index], **outcome.to_dict()}) + "\n")
    output.flush()


def summarize(outcomes: list) -> tuple[str, int]:
    """The closing line of `qrq score` (counts, and the commonest reason for failures) and its
    exit status: 0 every sample scored, 1 some not, 3 none (an empty input counts as success)."""
    counts = Counter(o.status for o in outcomes)
    line = "scored " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    failed = [o for o in outcomes if o.status not in ("ok", "cached")]
    if not failed:
        return line, 0
    reason, times = Counter(o.error or o.status for o in failed).most_common(1)[0]
    line += (
        f"; {len(failed)} of {len(outcomes)} samples not scored, most often ({times}x): "
        f"{reason[:300]}"
    )
    return line, EXIT_NONE_SCORED if len(failed) == len(outcomes) else EXIT_SOME_NOT_SCORED


def read_jsonl(lines_in, samples: list, lines: list[int], unreadable: dict[int, str]) -> None:
    """Append the samples (None for unreadable lines) to `samples`, their line numbers to
    `lines`, and why each unreadable one is to `unreadable` (what was read stays read when
    Ctrl-C stops it)."""
    for number, raw in enumerate(lines_in, start=1):
        if not raw.strip():
            continue
        try:
            sample = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            unreadable[len(samples)] = (
                f"line {number}: not UTF-8 ({exc.reason} at byte {exc.start})"
            )
            sample = None
        except ValueError as exc:
            unreadable[len(samples)] = f"line {number}: not JSON ({exc})"
            sample = None
        lines.append(number)
        samples.append(sample)


@cli.command()
@click.argument("backend_file", type=click.Path(exists=True, dir_okay=False))
@config_option
@click.option("-c", "--concurrency", type=int, help="Override the pool's concurrency.")
@click.option("-n", "--hostname", help="Worker node name (default: <backend>@%h).")
@click.option("--loglevel", default="INFO", show_default=True, help="Celery's log level.")
@click.option("--metrics-port", type=int, envvar="QRQ_METRICS_PORT",
              help="Serve Prometheus metrics of this worker (all pool processes) on this port.")
@click.option("--metrics-host", default="127.0.0.1", show_default=True,
              envvar="QRQ_METRICS_HOST", help="Interface of the metrics port (0.0.0.0: any; "
              "set QRQ_METRICS_TOKEN to require a bearer token).")
@click.option("-E", "--events", is_flag=True,
              help="Send task events from the start (Flower turns them on by itself).")
def worker(
    backend_file: str,
    config_path: str | None,
    concurrency: int | None,
    hostname: str | None,
    loglevel: str,
    metrics_port: int | None,
    metrics_host: str,
    events: bool,
) -> None:
    """Run a Celery worker for one backend: its queue, pool and rate limit from BACKEND_FILE."""
    from ..worker.boot import worker_app

    app, argv = worker_app(backend_file, config_path, concurrency, hostname, loglevel, events)
    if metrics_port:
        from ..ops.metrics import serve_worker

        serve_worker(metrics_port, metrics_host)
        _warn_if_open(metrics_host, "the worker's metrics", bool(os.environ.get(TOKEN_ENV)),
                      "set QRQ_METRICS_TOKEN")
        click.echo(f"metrics on {metrics_host}:{metrics_port}/metrics")
    app.worker_main(argv)


@cli.command()
@config_option
@click.option("--watch", is_flag=True, help="Redraw every --interval seconds until Ctrl-C.")
@click.option("--interval", type=float, default=2.0, show_default=True,
              help="Seconds between redraws of --watch.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document instead of the table.")
def status(config_path: str | None, watch: bool, interval: float, as_json: bool) -> None:
    """Each backend's queue by priority, rate limit, 429s, leases, adaptive limit, breaker, ETA."""
    from ..ops import status as view

    config = _load(config_path, required=False)
    if watch and not config.embedded:
        view.watch(config, interval, click.echo)
        return
    if not as_json:
        click.echo(describe_mode(config))
    click.echo(view.render_status(config, as_json))


@cli.command()
@config_option
@click.option("--route", help="Route to plan (default: the config's default route).")
@click.option("-n", "--samples", "n", type=int, required=True, help="Samples in the step.")
@click.option("--prompt-tokens", type=float, default=256, show_default=True,
              help="Mean tokens of a sample's prompt (and reference).")
@click.option("--response-tokens", type=float, default=512, show_default=True,
              help="Mean tokens of a sample's response.")
@click.option("--latency-ms", type=float, default=1000, show_default=True,
              help="Mean duration of one backend call.")
@click.option("--group-size", type=click.IntRange(1), default=8, show_default=True,
              help="Responses per prompt: a judge in group mode scores a group per call.")
@click.option("--metrics-url", "metrics_urls", multiple=True, metavar="URL",
              help="A worker's /metrics: use the backends' measured mean latency; repeatable.")
@click.option("--cpu-ms", type=float, default=1.0, show_default=True,
              help="CPU per sample of function backends.")
@click.option("--call-cpu-ms", type=float, default=3.0, show_default=True,
              help="Worker CPU per HTTP call (qrq's own work around it).")
@click.option("--workers", "workers", multiple=True, metavar="BACKEND=N",
              help="Worker processes of a backend (default 1 each); repeatable.")
@click.option("--cores", type=int, help="CPU cores of the worker machines (default: this one's).")
@click.option("--target-s", type=float, help="Say what to change to finish within this time.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document instead of the table.")
def plan(config_path, route, n, prompt_tokens, response_tokens, latency_ms, group_size,
         metrics_urls, cpu_ms, call_cpu_ms, workers, cores, target_s, as_json) -> None:
    """Predict the reward step's wall time, the binding limit of each backend, what to change."""
    from ..ops.plan import Workload, plan_route, render_plan

    config = load_config(config_path)
    counts = {}
    for item in workers:
        name, _, count = item.partition("=")
        if name not in config.backends or not count.isdigit():
            raise ConfigError(f"--workers {item!r}: expected BACKEND=N with a known backend")
        counts[name] = int(count)
    measured = {}
    if metrics_urls:
        from ..ops.metrics import measured_latency_s

        measured = measured_latency_s(metrics_urls)
    work = Workload(n, prompt_tokens, response_tokens, latency_ms / 1000, cpu_ms / 1000,
                    call_cpu_ms / 1000, counts, **({"cores": cores} if cores else {}),
                    measured_latency_s=measured, group_size=group_size)
    result = plan_route(config, route, work, target_s)
    click.echo(json.dumps(result.to_dict()) if as_json else render_plan(result))


@cli.command()
@config_option
@click.option("--port", type=int, default=9808, show_default=True,
              help="Port of the /metrics endpoint Prometheus scrapes.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to bind (0.0.0.0: any; set QRQ_METRICS_TOKEN to require a "
                   "bearer token).")
def exporter(config_path: str | None, port: int, host: str) -> None:
    """Serve the shared Redis state (queues by priority, leases, limits, breaker) to Prometheus."""
    from ..broker.app import QrqCelery
    from ..ops.exporter import serve_exporter

    config = load_config(config_path)
    if config.embedded:
        raise ConfigError("qrq exporter needs Redis: set QRQ_REDIS_URL or [redis] url in qrq.toml")
    serve_exporter(QrqCelery(config), port, host)
    _warn_if_open(host, "the exporter", bool(os.environ.get(TOKEN_ENV)), "set QRQ_METRICS_TOKEN")
    click.echo(describe_mode(config) + f"; exporter on {host}:{port}/metrics")
    while True:
        time.sleep(3600)


@cli.command("audit")
@config_option
@click.option("--route", "route_name", required=True, help="An audited route.")
@click.option("--limit", default=20, show_default=True, help="How many, newest first.")
def audit_command(config_path: str | None, route_name: str, limit: int) -> None:
    """The audit lane of a route: its agreement per hour, then the samples its judge and the
    audit route disagreed on, one JSON line each (newest first)."""
    from ..config.redis_conn import connect
    from ..ops import audit

    config = load_config(config_path)
    if config.embedded:
        raise ConfigError("qrq audit needs Redis: set QRQ_REDIS_URL or [redis] url")
    route = config.route(route_name)
    if route.audit is None:
        raise ConfigError(f"{config.source}: routes.{route.name} has no audit lane "
                          '(audit = { route = "...", fraction = 0.02 })')
    store = connect(config)
    for line in audit.render(route.name, audit.hours(store, route.name)) or [
            f"  {route.name}: nothing audited in the last 24 h"]:
        click.echo(line.strip())
    for entry in audit.disagreements(store, route.name, limit):
        click.echo(json.dumps(entry))


@cli.command("dead-letters")
@config_option
@click.option("--limit", default=20, show_default=True, help="How many, newest first.")
def dead_letters(config_path: str | None, limit: int) -> None:
    """Malformed task messages the workers refused, one JSON line each (newest first)."""
    from ..config.redis_conn import connect, describe
    from ..ops.dead_letter import read

    config = load_config(config_path)
    if config.embedded:
        raise ConfigError("qrq dead-letters needs Redis: set QRQ_REDIS_URL or [redis] url")
    entries = read(connect(config), limit)
    for entry in entries:
        click.echo(json.dumps(entry))
    if not entries:
        click.echo(f"qrq: no dead letters in Redis at {describe(config)}: every task message "
                   "the workers received was well-formed", err=True)


@cli.command()
@config_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to bind (0.0.0.0 for trainer nodes on other machines: configure "
                   "[gateway] keys first).")
@click.option("--port", default=8000, show_default=True, help="Port to listen on.")
@click.option("--route", help="Route of the RM endpoints (default: the config's default route).")
@click.option("--max-items", default=64, show_default=True, help="Samples per micro-batch.")
@click.option("--max-wait-ms", default=20.0, show_default=True,
              help="Longest wait to fill one (the RM endpoints).")
@click.option("--chat-max-wait-ms", default=0.0, show_default=True,
              help="Longest wait to fill one (chat requests; 0: each goes at once unless "
                   "--max-in-flight micro-batches are out).")
@click.option("--max-in-flight", default=4, show_default=True,
              help="Micro-batches out at once per batcher; past that, requests wait (up to "
                   "50 ms) for one to end and go together (0: no limit).")
@click.option("--deadline-s", type=float,
              help="Answer by then (default 150 s for OpenRLHF, 100 s for slime).")
def gateway(config_path: str | None, host: str, port: int, route: str | None, max_items: int,
            max_wait_ms: float, chat_max_wait_ms: float, max_in_flight: int,
            deadline_s: float | None) -> None:
    """Remote-RM HTTP server (OpenRLHF POST /get_reward, slime POST /slime) and an
    OpenAI-compatible front door (POST /v1/chat/completions, POST /v1/completions, GET
    /v1/models); GET /health."""
    from ..integrations.gateway import Gateway, serve
    from ..integrations.gateway_keys import OPEN_JOB, Keys
    from ..trainer.batcher import MicroBatcher
    from ..trainer.runtime import configure

    app = configure(config_path)
    if route or app.qrq_config.default_route:  # chat requests name theirs; the RM endpoints
        app.qrq_config.route(route)  # use this one: an unknown one fails here, not later
    keys = Keys.load(app.qrq_config.gateway)
    if keys.open:
        click.echo(f"qrq: no [gateway] keys configured: every caller is served as one job, "
                   f"{OPEN_JOB!r}, at any priority", err=True)
    _warn_if_open(host, "the gateway", not keys.open, "configure [gateway] keys_env or keys_file")
    click.echo(describe_mode(app.qrq_config) + f"; gateway on http://{host}:{port}"
               " (POST /get_reward, POST /slime, POST /v1/chat/completions, POST /v1/completions,"
               " GET /v1/models, GET /health)")
    deadlines = {} if deadline_s is None else {"openrlhf_deadline_s": deadline_s,
                                               "slime_deadline_s": deadline_s}
    out = max_in_flight or None
    serve(host, port, Gateway(route, MicroBatcher(max_items, max_wait_ms, max_in_flight=out),
                              **deadlines, keys=keys,
                              chat_batcher=MicroBatcher(max_items, chat_max_wait_ms,
                                                        max_in_flight=out)))


def _warn_if_open(host: str, what: str, authenticated: bool, how: str) -> None:
    """Say so when `what` listens beyond this machine and anyone may call it."""
    from ..ops.metrics_http import is_loopback

    if not authenticated and not is_loopback(host):
        click.echo(f"qrq: warning: {what} listens on {host} without authentication: anyone "
                   f"who reaches it may use it ({how})", err=True)


def main() -> None:
    cli(prog_name="qrq")


if __name__ == "__main__":
    main()
