"""The sample outputs of README.md and the docs pages, produced by real runs of qrq.

    python docs/readme_samples.py --check [NAME ...]   # each marked block against a fresh run
    python docs/readme_samples.py --write [NAME ...]   # put the fresh output into its page
    python docs/readme_samples.py --list

A block of README.md or of a page under docs/ is marked by `<!-- sample: NAME -->` on the line
before its fence (each name once in all of them). Most
samples are cheap (a second or two, a few need Redis: --redis-url, default $QRQ_SAMPLES_REDIS_URL
else redis://127.0.0.1:6379/15, flushed) and compared exactly, after the machine's own paths
are replaced by the ones README shows. `demo` takes a minute and its figures differ run to run:
it is compared with the digits masked, and only when named or with --slow.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]  # where samples are shown
# the marker, then the fenced block (indented as a whole inside a list item, as README's are)
MARK = re.compile(r"<!-- sample: ([\w-]+) -->\n( *)```[^\n]*\n(.*?)\2```", re.S)
CLOSED_URL = "redis://:pw@127.0.0.1:6390/0"  # nothing may listen on 6390 (checked)
SHOWN_REDIS = "redis://127.0.0.1:6379"  # README's Redis; --redis-url's server is shown as it


def qrq(*args: str, cwd: Path = ROOT, env: dict | None = None, timeout: float = 120,
        python: tuple[str, ...] = ("-m", "qreward_queue.cli")) -> subprocess.CompletedProcess:
    """Run qrq as a user would: no QRQ_* variable but those in `env`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("QRQ_")}
    return subprocess.run([sys.executable, *python, *args], cwd=cwd, env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def shown(command: str, run: subprocess.CompletedProcess, *, stdout: bool = True) -> str:
    """`$ command` and what the user sees (stderr, and stdout unless told not to)."""
    return f"$ {command}\n" + (run.stdout if stdout else "") + run.stderr


@contextlib.contextmanager
def copy_of_repo_config() -> Iterator[Path]:
    """A scratch directory holding the repository's qrq.toml and workers/."""
    with tempfile.TemporaryDirectory(prefix="qrq-readme-") as tmp:
        shutil.copy(ROOT / "qrq.toml", tmp)
        shutil.copytree(ROOT / "workers", Path(tmp) / "workers")
        yield Path(tmp)


def plan(_: str) -> str:
    command = ("qrq plan --route demo -n 8192 --prompt-tokens 200 --response-tokens 400 "
               "--latency-ms 200 --target-s 30 --cores 2")
    return shown(command, qrq(*command.split()[1:], env={"QRQ_CONFIG": "qrq.toml"}))


def redis_errors(redis_url: str) -> str:
    with contextlib.suppress(redis.ConnectionError):
        redis.Redis.from_url(CLOSED_URL, socket_connect_timeout=1).ping()
        raise SystemExit(f"something answers at {CLOSED_URL}: the sample needs it closed")
    out = []
    for url in (CLOSED_URL, f"{server(redis_url)}/99"):
        out.append(shown(f"QRQ_REDIS_URL={url} qrq status", qrq("status", env={
            "QRQ_REDIS_URL": url})))
    command = "qrq worker workers/mock-a.toml"
    out.append(shown(f"QRQ_REDIS_URL={CLOSED_URL} {command}",
                     qrq(*command.split()[1:], env={"QRQ_REDIS_URL": CLOSED_URL})))
    return "".join(out).replace(server(redis_url), SHOWN_REDIS)


def server(redis_url: str) -> str:
    """`redis://host:port` of a Redis URL, without its password and database."""
    return redact(redis_url).rsplit("/", 1)[0]


def missing_extra(_: str) -> str:
    # the gateway's aiohttp made unimportable, as in a virtualenv without the `gateway` extra
    blocked = ("-c", "import sys; sys.modules['aiohttp'] = None; "
               "from qreward_queue.cli.main import main; sys.argv[0] = 'qrq'; main()")
    return shown("qrq gateway --route demo", qrq("gateway", "--route", "demo", python=blocked))


def api_key(redis_url: str) -> str:
    with copy_of_repo_config() as tmp:  # the template copied as its first line says
        shutil.copy(tmp / "workers" / "openai.toml.example", tmp / "workers" / "openai.toml")
        command = "qrq worker workers/openai.toml"
        env = {"QRQ_REDIS_URL": redis_url, "OPENAI_API_KEY": ""}
        return ("$ cp workers/openai.toml.example workers/openai.toml\n"
                + shown(command, qrq(*command.split()[1:], cwd=tmp, env=env)))


def config_errors(_: str) -> str:
    with copy_of_repo_config() as tmp:
        file = tmp / "workers" / "mock-a.toml"
        file.write_text(file.read_text().replace("rpm = 6000", "rpm = 'fast'")
                        .replace("max_concurrent = 32", "max_concurent = 32"))
        return shown("qrq status", qrq("status", cwd=tmp))


def config_not_found(_: str) -> str:
    with tempfile.TemporaryDirectory(prefix="qrq-readme-") as tmp:
        (Path(tmp) / "in.jsonl").write_text('{"prompt": "p", "response": "r"}\n')
        text = shown("qrq score in.jsonl", qrq("score", "in.jsonl", cwd=Path(tmp)))
        return text.replace(str(Path(tmp).resolve()), "/home/me").replace(tmp, "/home/me")


def score_without_judges(_: str) -> str:
    for port in (8101, 8102):  # the example judges' ports must be closed
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                raise SystemExit(f"port {port} is in use: this sample needs it closed")
    samples = [{"prompt": f"What is {i}+1?", "response": str(i + 1), "reference": str(i + 1)}
               for i in range(16)]
    with copy_of_repo_config() as tmp:
        (tmp / "in.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
        run = qrq("score", "in.jsonl", "-o", "out.jsonl", "--route", "demo", cwd=tmp)
    return (shown("qrq score in.jsonl -o out.jsonl --route demo", run)
            + f"$ echo $?\n{run.returncode}\n")


def no_worker(redis_url: str) -> str:
    redis.Redis.from_url(redis_url).flushdb()
    with copy_of_repo_config() as tmp:
        (tmp / "in.jsonl").write_text('{"prompt": "What is 2+2?", "response": "4"}\n')
        command = "qrq score in.jsonl -o out.jsonl --route mock-a --deadline-s 8"
        run = qrq(*command.split()[1:], cwd=tmp, env={"QRQ_REDIS_URL": redis_url})
    return shown(command, run).replace(redact(redis_url), f"{SHOWN_REDIS}/0")


def status(redis_url: str) -> str:
    """`qrq status` with a training and a validation batch queued before any worker runs."""
    redis.Redis.from_url(redis_url).flushdb()
    env = {"QRQ_REDIS_URL": redis_url, "QRQ_CONFIG": "qrq.toml"}
    code = ("import qreward_queue as q\n"
            "from qreward_queue.cli.demo import grpo_batch\n"
            "samples = grpo_batch()\n"
            "q.submit_batch(samples, route='demo', priority='train')\n"
            "q.submit_batch(samples[:64], route='demo', priority='val')\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60,
                   env={**os.environ, **env}, capture_output=True)
    text = shown("qrq status", qrq("status", env=env))
    return text.replace(redact(redis_url), f"{SHOWN_REDIS}/0")


GROUP_BACKEND = """\
[backend]
kind = "judge"
url = "${JUDGE_URL:-http://127.0.0.1:8101}/v1"
model = "mock"
mode = "group"   # one call per GRPO group: the prompt once, the responses numbered
group_max = 8    # a larger group is judged in balanced parts (9 -> 5 + 4)

[limits]
tpm = 1200000
"""
GROUP_CODE = """\
import qreward_queue as qrq

prompt = "What is 17 x 23? Show your steps."
group = [{"prompt": prompt, "response": r}
         for r in ("391", "17 x 23 = 391", "381", "I don't know")]
broken = [{"prompt": "Rate these [[mock:group-few]]", "response": r} for r in "ab"]
batch = qrq.submit_batch(group + broken, route="grouper")
for o in batch.outcomes():
    print(o.status, o.score, *([o.error, "| reply:", repr(o.detail)] if o.error else []))
print(batch.summary()["spend"])
"""


def group_judging(_: str) -> str:
    """README's group-mode example (GROUP_BACKEND, GROUP_CODE) against a mock judge."""
    from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn

    with tempfile.TemporaryDirectory(prefix="qrq-readme-") as tmp, \
            spawn(MockJudgeSettings(latency_ms=20)) as judge:
        (Path(tmp) / "workers").mkdir()
        (Path(tmp) / "workers" / "grouper.toml").write_text(GROUP_BACKEND)
        (Path(tmp) / "qrq.toml").write_text('workers_dir = "workers"\n')
        (Path(tmp) / "group.py").write_text(GROUP_CODE)
        env = {**os.environ, "JUDGE_URL": judge.url, "QRQ_CONFIG": "qrq.toml"}
        env.pop("QRQ_REDIS_URL", None)
        run = subprocess.run([sys.executable, "group.py"], cwd=tmp, env=env, timeout=120,
                             capture_output=True, text=True)
    return shown("python group.py", run)


def init(_: str) -> str:
    """README's `qrq init` for an API judge, in an empty directory."""
    with tempfile.TemporaryDirectory(prefix="qrq-readme-") as tmp:
        run = qrq("init", "--judge-url", "https://api.openai.com/v1", "--model", "gpt-4o-mini",
                  "--api-key-env", "OPENAI_API_KEY", "--rpm", "500", cwd=Path(tmp))
    return run.stdout + run.stderr


def demo(_: str) -> str:
    with tempfile.TemporaryDirectory(prefix="qrq-readme-") as tmp:
        run = qrq("demo", cwd=Path(tmp), timeout=600)
    return run.stdout + run.stderr


def redact(url: str) -> str:
    from qreward_queue.redact import redact_url

    return redact_url(url)


SAMPLES: dict[str, Callable[[str], str]] = {
    "plan": plan, "redis-errors": redis_errors, "missing-extra": missing_extra,
    "api-key": api_key, "config-errors": config_errors, "config-not-found": config_not_found,
    "score-without-judges": score_without_judges, "no-worker": no_worker, "status": status,
    "group-judging": group_judging, "init": init, "demo": demo,
}
SLOW = {"demo"}


def as_shown(text: str) -> str:
    """The installed package's directory as README shows it: `...`."""
    from qreward_queue.config.model import PACKAGED_CONFIG

    return text.replace(str(PACKAGED_CONFIG.parent.parent.parent), "...")


def normalize(name: str, text: str) -> str:
    """What a sample must match: as shown, with the figures masked for the demo, whose figures
    vary run to run."""
    text = as_shown(text)
    if name not in SLOW:
        return text
    # figures masked, and the table's padding, which follows their widths
    return re.sub(r" +", " ", re.sub(r"\d+(\.\d+)?", "N", text))


def blocks(text: str) -> dict[str, str]:
    """Each marked block of a page, by name, without the indentation of a list item."""
    return {m.group(1): re.sub(rf"(?m)^{m.group(2)}", "", m.group(3))
            for m in MARK.finditer(text)}


def page_of(name: str) -> Path | None:
    """The page (README.md or a docs page) that shows sample `name`."""
    return next((page for page in PAGES if name in blocks(page.read_text())), None)


def check(name: str, redis_url: str) -> str | None:
    """None when the block `name` matches a fresh run, else what differs."""
    page = page_of(name)
    if page is None:
        return f"no page has a block marked <!-- sample: {name} -->"
    shown_text = blocks(page.read_text())[name]
    fresh = SAMPLES[name](redis_url)
    if normalize(name, fresh) == normalize(name, shown_text):
        return None
    where = page.relative_to(ROOT)
    return f"{where}'s sample {name!r} differs from a fresh run:\n--- {where}\n{shown_text}" \
           f"--- fresh run\n{fresh}"


def write(name: str, redis_url: str) -> None:
    page = page_of(name)
    if page is None:
        raise SystemExit(f"no page has a block marked <!-- sample: {name} -->")
    fresh = as_shown(SAMPLES[name](redis_url))
    text = page.read_text()
    match = {m.group(1): m for m in MARK.finditer(text)}[name]
    indent = match.group(2)
    start, end = match.span(3)
    page.write_text(text[:start] + re.sub(r"(?m)^(?=.)", indent, fresh) + text[end:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--check", action="store_true")
    action.add_argument("--write", action="store_true")
    action.add_argument("--list", action="store_true")
    parser.add_argument("names", nargs="*", metavar="NAME")
    parser.add_argument("--slow", action="store_true", help="also the demo (a minute)")
    parser.add_argument("--redis-url", default=os.environ.get(
        "QRQ_SAMPLES_REDIS_URL", "redis://127.0.0.1:6379/15"))
    args = parser.parse_args()
    names = args.names or [n for n in SAMPLES if args.slow or n not in SLOW]
    if args.list:
        print("\n".join(SAMPLES))
        return
    failed = 0
    for name in names:
        started = time.monotonic()
        if args.write:
            write(name, args.redis_url)
            print(f"wrote {name} ({time.monotonic() - started:.1f} s)")
            continue
        problem = check(name, args.redis_url)
        failed += problem is not None
        print(problem or f"ok  {name} ({time.monotonic() - started:.1f} s)")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
