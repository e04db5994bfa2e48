"""qrq: demo, score, worker, status, mock-judge. Errors are one clear line, not a traceback."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import click

from .config import load_backend, load_config
from .errors import ConfigError, QrqError
from .mock_judge import mock_judge_cli
from .runtime import describe_mode


class _Group(click.Group):
    """Turns qrq's own errors into `qrq: error: ...` and exit status 2."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except QrqError as exc:
            click.echo(f"qrq: error: {exc}", err=True)
            ctx.exit(2)


@click.group(cls=_Group)
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
@config_option
@click.option("--route", help="Route to score on (default: the config's default route).")
def demo(config_path: str | None, route: str | None) -> None:
    """Start mock judges and score a 1,024-sample GRPO batch: qrq vs a naive client."""
    from .demo import run_demo
    from .runtime import shutdown

    config = load_config(config_path)
    click.echo(describe_mode(config))
    try:
        ok = run_demo(config, click.echo, route)
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
    "--priority", type=click.Choice(["val", "train", "bulk"]), default="bulk", show_default=True
)
@click.option("--deadline-s", type=float, help="Return by then; the rest comes back as timeout.")
@config_option
def score(input_file, output, route, priority, deadline_s, config_path) -> None:
    """Score the samples in IN.jsonl (one JSON object per line), in order."""
    from tqdm import tqdm

    from .client import submit_batch
    from .runtime import configure, shutdown

    config = load_config(config_path)
    click.echo(describe_mode(config), err=True)
    app = configure(config)
    samples, lines, unreadable = read_jsonl(input_file)
    try:
        batch = submit_batch(samples, route, priority, deadline_s, on_invalid="outcome", app=app)
        with tqdm(total=len(batch), unit="sample", file=sys.stderr, disable=None) as bar:
            while not batch.done() and time.time() < batch.deadline:
                bar.update(batch.completed - bar.n)
                time.sleep(0.2)
            outcomes = batch.outcomes()
            bar.update(len(batch) - bar.n)
    finally:
        shutdown()
    counts: dict[str, int] = {}
    for index, outcome in enumerate(outcomes):
        if index in unreadable:
            outcome.error = unreadable[index]
        elif outcome.error and outcome.error.startswith("invalid sample"):
            outcome.error = f"line {lines[index]}: {outcome.error}"
        counts[outcome.status] = counts.get(outcome.status, 0) + 1
        output.write(json.dumps({"index": index, "line": lines[index], **outcome.to_dict()}) + "\n")
    output.flush()
    click.echo("scored " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())), err=True)


def read_jsonl(lines_in) -> tuple[list, list[int], dict[int, str]]:
    """Samples (None for unreadable lines), their line numbers, and why each unreadable one is."""
    samples, lines, unreadable = [], [], {}
    for number, raw in enumerate(lines_in, start=1):
        if not raw.strip():
            continue
        lines.append(number)
        try:
            samples.append(json.loads(raw.decode("utf-8")))
        except UnicodeDecodeError as exc:
            unreadable[len(samples)] = (
                f"line {number}: not UTF-8 ({exc.reason} at byte {exc.start})"
            )
            samples.append(None)
        except ValueError as exc:
            unreadable[len(samples)] = f"line {number}: not JSON ({exc})"
            samples.append(None)
    return samples, lines, unreadable


@cli.command()
@click.argument("backend_file", type=click.Path(exists=True, dir_okay=False))
@config_option
@click.option("-c", "--concurrency", type=int, help="Override the pool's concurrency.")
@click.option("-n", "--hostname", help="Worker node name (default: <backend>@%h).")
@click.option("--loglevel", default="INFO", show_default=True)
def worker(
    backend_file: str,
    config_path: str | None,
    concurrency: int | None,
    hostname: str | None,
    loglevel: str,
) -> None:
    """Run a Celery worker for one backend: its queue, pool and rate limit from BACKEND_FILE."""
    from .app import QrqCelery
    from .tasks import TASK_NAME

    config = load_config(config_path)
    backend = load_backend(backend_file)
    if config.embedded:
        raise ConfigError("qrq worker needs Redis: set QRQ_REDIS_URL or [redis] url in qrq.toml")
    known = config.backends.get(backend.name)
    if known is not None and Path(known.source).resolve() != Path(backend_file).resolve():
        raise ConfigError(
            f"{backend_file}: backend {backend.name!r} is also defined in {known.source}"
        )
    app = QrqCelery(
        dataclasses.replace(config, backends={**config.backends, backend.name: backend})
    )
    if backend.pool.rate_limit:
        app.conf.task_annotations = {TASK_NAME: {"rate_limit": backend.pool.rate_limit}}
    argv = [
        "worker",
        "-Q",
        backend.queue,
        "-P",
        backend.pool.type,
        "-c",
        str(concurrency or backend.pool.concurrency),
        "-n",
        hostname or f"{backend.name}@%h",
        "--loglevel",
        loglevel,
        "-E",
    ]
    if backend.pool.type == "prefork":
        argv += ["--max-tasks-per-child", str(backend.pool.max_tasks_per_child)]
        if backend.pool.max_memory_per_child_mb:
            argv += ["--max-memory-per-child", str(backend.pool.max_memory_per_child_mb * 1024)]
    click.echo(
        describe_mode(config) + f"; worker for backend {backend.name!r} on queue {backend.queue}"
    )
    app.worker_main(argv)


@cli.command()
@config_option
def status(config_path: str | None) -> None:
    """Each backend's queue depth, bucket levels, leases, adaptive concurrency and 429s."""
    from .status import render_status

    config = load_config(config_path)
    click.echo(describe_mode(config))
    click.echo(render_status(config))


def main() -> None:
    cli(prog_name="qrq")


if __name__ == "__main__":
    main()
