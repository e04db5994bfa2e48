"""README and the docs pages tell the truth: the paths they name exist, their `qrq ...` command
lines parse, the Python names they give import, their verl keys are the ones checked against
verl itself, and their sample outputs match a fresh run (docs/readme_samples.py). README stays
a front door of at most 200 lines."""

from __future__ import annotations

import ast
import importlib
import re
import shlex
import shutil
import sys

import click
import pytest
from support import ROOT

from qreward_queue.cli.main import cli
from qreward_queue.config.loader import load_backend

README = (ROOT / "README.md").read_text()
# README and every docs page, by path (the site's home page is README itself)
PAGES = {str(path.relative_to(ROOT)): path.read_text()
         for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]}
ALL = "\n".join(PAGES.values())
sys.path.insert(0, str(ROOT / "docs"))
import readme_samples  # noqa: E402

# a path in the repository: one of its top-level directories, then more of the path
PATH = re.compile(r"(?<![\w./~-])((?:qreward_queue|tests|benchmarks|examples|deploy|docs|"
                  r"workers|\.ci)/[\w./{},*<>-]*[\w*}>])")
PLACEHOLDER = re.compile(r"<[\w-]+>")  # workers/<backend>.toml: stands for any backend file


def paths_named() -> set[str]:
    return set(PATH.findall(ALL)) - set(copied().values()) - written()


def written() -> set[str]:
    """Files the pages' `qrq init` samples say they wrote (`wrote workers/judge.toml`)."""
    return set(re.findall(r"^ *wrote (\S+)$", ALL, re.M))


def copied() -> dict[str, str]:
    """`$ cp SRC DST` lines of the pages' samples: DST exists once the reader ran them."""
    return dict(re.findall(r"^\$ cp (\S+) (\S+)$", ALL, re.M))


def expand(path: str) -> list[str]:
    """`a/{b,c}.toml` -> a/b.toml, a/c.toml."""
    match = re.search(r"\{([^}]*)\}", path)
    if not match:
        return [path]
    return [p for part in match.group(1).split(",")
            for p in expand(path[:match.start()] + part + path[match.end():])]


@pytest.mark.parametrize("path", sorted(paths_named()))
def test_every_path_readme_names_exists(path):
    for one in expand(path):
        pattern = PLACEHOLDER.sub("*", one)
        assert list(ROOT.glob(pattern)) if "*" in pattern else (ROOT / one).exists(), one


def command_lines(text: str = ALL) -> list[str]:
    """Every qrq command line a page shows: in bash blocks, after `$ ` in output blocks, and
    in inline code (env assignments before it, `&&` and continuation lines understood)."""
    lines = []
    for lang, block in re.findall(r"```([^\n]*)\n(.*?)```", text, re.S):
        block = block.replace("\\\n", " ")
        lines += [line.strip() for line in block.splitlines()
                  if lang == "bash" or line.strip().startswith("$ ")]
    lines += re.findall(r"(?<!`)`([^`\n]*\bqrq [^`\n]*)`", text)
    found = []
    for line in lines:
        for part in line.split("&&"):
            try:
                words = shlex.split(part.split(" #")[0].strip().removeprefix("$ "))
            except ValueError:  # unbalanced quotes: Python or prose, not a shell line
                continue
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words = words[1:]
            if words and words[0] in ("qrq", ".venv/bin/qrq"):
                found.append(" ".join(words))
    return found


def parse(words: list[str]) -> None:
    """Parse `qrq WORDS` as the CLI would, without running the command."""
    group = cli.make_context("qrq", list(words))
    name, command, rest = cli.resolve_command(group, group._protected_args + group.args)
    command.make_context(name, rest, parent=group)


@pytest.mark.parametrize("line", sorted(set(command_lines())))
def test_every_qrq_command_line_parses(line, tmp_path, monkeypatch):
    # run from a copy of the repository's top level, with the input files the lines read
    for entry in ROOT.iterdir():
        if entry.name == "workers":  # a copy: README's `cp` lines add files to it
            shutil.copytree(entry, tmp_path / entry.name)
        else:
            (tmp_path / entry.name).symlink_to(entry)
    for source, target in copied().items():
        shutil.copy(tmp_path / source, tmp_path / target)
    for target in written():
        if not (tmp_path / target).exists():
            (tmp_path / target).write_text("")
    words = [PLACEHOLDER.sub("mock-a", w) for w in shlex.split(line)[1:]]
    for word in words:
        if word.endswith(".jsonl") and not (tmp_path / word).exists():
            (tmp_path / word).write_text("")
    monkeypatch.chdir(tmp_path)
    if len(words) == 1 and not words[0].startswith("-"):  # a command named in prose
        assert words[0] in cli.commands, line
        return
    try:
        parse(words)
    except click.exceptions.Exit:  # --version, --help: parsed, then done
        pass
    except click.UsageError as exc:
        pytest.fail(f"the docs' `{line}` does not parse: {exc.format_message()}")


def test_readme_shows_many_command_lines():  # the extraction above must keep finding them
    commands = {line.split()[1] for line in command_lines()}
    assert {"demo", "score", "worker", "status", "plan", "exporter", "gateway", "mock-judge",
            "dead-letters", "init"} <= commands
    assert {"init", "score", "worker"} <= {line.split()[1] for line in command_lines(README)}


def test_readme_is_a_front_door():
    assert len(README.splitlines()) <= 200
    # the two commands, exactly as CI and the demo test run them
    assert "python3 -m venv .venv && .venv/bin/pip install -q -e . && .venv/bin/qrq demo" in README
    assert "```bash\nbash .ci/test.sh\n```" in README
    # the site's nav holds every page (`mkdocs build --strict` refuses one left out, too)
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in PAGES:
        if page.startswith("docs/"):
            assert f": {page.removeprefix('docs/')}" in nav, page


@pytest.mark.parametrize("name", sorted(set(re.findall(r"\bqreward_queue(?:\.\w+)+", ALL))))
def test_every_python_name_readme_gives_imports(name):
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attr in parts[split:]:
            assert hasattr(obj, attr), name
            obj = getattr(obj, attr)
        return
    pytest.fail(f"{name} does not import")


def verl_keys(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w.])\+?(?:reward|reward_model|custom_reward_function)"
                          r"\.[\w.]+=[^\s`,]+", text))


def checked_verl_overrides() -> set[str]:
    """The overrides tests/trainers/test_trainers_real.py composes with verl's own config (CI
    runs it with verl 0.9.1 installed: bash .ci/trainers.sh), read without importing it."""
    tree = ast.parse((ROOT / "tests" / "trainers" / "test_trainers_real.py").read_text())
    lists = [ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
             and getattr(node.targets[0], "id", None) in ("VERL_MANAGER", "VERL_FUNCTION")]
    assert len(lists) == 2
    return {*lists[0], *lists[1], "reward.reward_manager.name=qrq"}  # the plugin's name, too


def test_verl_keys_are_the_ones_checked_against_verl():
    checked = checked_verl_overrides()
    options = {"+reward.qrq.deadline_s=250", "+reward.qrq.on_unscored=raise"}
    source = (ROOT / "qreward_queue" / "integrations" / "verl.py").read_text()
    assert all(f'settings.get("{k.split("=")[0].rsplit(".", 1)[1]}"' in source for k in options)
    for text in (*PAGES.values(), (ROOT / "examples" / "verl_reward.py").read_text()):
        assert verl_keys(text) <= checked | options


def test_the_mock_judge_readme_starts_is_the_one_the_worker_files_are_sized_for():
    (line,) = [c for c in command_lines() if c.startswith("qrq mock-judge --port 8101")]
    options = cli.commands["mock-judge"].make_context("mock-judge", shlex.split(line)[2:]).params
    backend = load_backend(ROOT / "workers" / "mock-a.toml")
    assert f":{options['port']}/" in backend.options.url
    assert options["rpm"] == backend.limits.rpm
    assert options["max_concurrent"] == backend.limits.max_concurrent and backend.pool.sized


@pytest.mark.parametrize("page", sorted(PAGES))
def test_readme_names_no_internal_tool(page):
    assert not re.search(r"`(duplicates|issues|search|fetch)\b", PAGES[page])


def test_every_example_says_its_extra():
    examples_page = PAGES["docs/examples.md"]
    for example in (ROOT / "examples").glob("*.py"):
        if not example.name.startswith("_"):
            assert f"examples/{example.name}" in examples_page, example.name
    assert "qreward-queue[examples]" in examples_page and "qreward-queue[gateway]" in examples_page


@pytest.mark.parametrize("name", [n for n in readme_samples.SAMPLES
                                  if n not in readme_samples.SLOW])
def test_sample_output_matches_a_fresh_run(name, redis_url):
    assert readme_samples.check(name, redis_url) is None


ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()
# a module or folder as the architecture page and README's module table name them: under
# qreward_queue/ (`worker/tasks.py`, `flow/lua/`) or dotted (`qreward_queue.worker.tasks`)
MODULE_PATH = re.compile(r"(?<![\w./<>-])((?:\w+/)*\w+(?:\.py|/))(?![\w<])")
DOTTED = re.compile(r"\bqreward_queue(?:\.\w+)+")


def named_modules(text: str) -> set[str]:
    return set(MODULE_PATH.findall(text)) | {n.replace(".", "/") for n in DOTTED.findall(text)}


def exists(name: str) -> bool:
    """Under the package, or (a path that starts with a top-level folder) under the root."""
    return any((base / name).exists() or (base / f"{name}.py").exists()
               for base in (ROOT / "qreward_queue", ROOT))


def test_every_module_the_architecture_page_names_exists():
    names = named_modules(ARCHITECTURE)
    assert {"trainer/client.py", "worker/tasks.py", "flow/lua/", "ops/status.py",
            "backends/transport.py", "testing/mock_judge/"} <= names  # the parse finds them
    assert not sorted(n for n in names if not exists(n))


def test_every_module_the_module_table_names_exists():
    table = re.findall(r"^\| ((?:`[^`]+`(?: \+ | / )?)+) \|", ARCHITECTURE, re.M)
    names = {n for row in table for n in re.findall(r"`([^`]+)`", row)
             if n.endswith((".py", "/"))}
    assert {"worker/call_path.py", "flow/limiter.py", "backends/"} <= names
    assert not sorted(n for n in names if not exists(n))
