"""The package's import structure: no module imports itself back, and a trainer's import
loads only the trainer's side (no backend transport, call pool, sandbox or Prometheus)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import qreward_queue

PACKAGE = Path(qreward_queue.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported(path: Path, modules: set[str]) -> set[str]:
    """The package modules `path` imports when run, at its top or inside a function (not
    under `if TYPE_CHECKING:`, which never runs)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:  # a submodule, or a name the module `base` defines
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imported(p, modules) for p in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each group of modules that import each other (Tarjan's SCCs)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while (w := stack.pop()) != v:
                group.add(w)
            group.add(v)
            if len(group) > 1:
                found.append(path_through(graph, group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def path_through(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest cycle from the group's first module back to itself (breadth first)."""
    start = min(group)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in parents:
                    parents[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"{group} is no cycle")


def test_the_walk_sees_imports_inside_functions():
    """The walk would see a circle made through a function-level import."""
    graph = import_graph()
    assert "qreward_queue.ops.status" in graph["qreward_queue.cli.main"]  # `as view`, in a function
    assert "qreward_queue.ops.metrics" in graph["qreward_queue.worker.tasks"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


# The sides, in the order imports may run (docs/architecture.md, "The map"): a module imports
# its own side's modules and those of the sides after it, never one before it. The loader sits
# with the planner: it asks each backend kind and the ensemble for their options.
CONTRACT = ("errors", "samples", "message", "keys", "priority", "redact", "background",
            "flushing")
SIDES = (
    ("cli",),
    ("integrations",),
    ("trainer",),
    ("worker",),
    ("ops", "testing"),
    ("planning", "config.loader"),
    ("broker", "backends", "rewards"),
    ("config",),
    ("flow",),
    CONTRACT,
)


def side(module: str) -> int | None:
    """The index in SIDES of `module`'s side (None: the package's own `__init__`, the public
    names a user imports, which may load any side)."""
    name = module.removeprefix("qreward_queue").removeprefix(".")
    if not name:
        return None
    found = [(len(prefix), i) for i, prefixes in enumerate(SIDES) for prefix in prefixes
             if name == prefix or name.startswith(prefix + ".")]
    assert found, f"{module} belongs to no side: give it a folder (or add it to SIDES)"
    return max(found)[1]


def against_the_order(graph: dict[str, set[str]]) -> list[str]:
    """Each import that runs from a later side to an earlier one."""
    return [f"{a} -> {b}" for a in sorted(graph) for b in sorted(graph[a])
            if None not in (side(a), side(b)) and side(a) > side(b)]  # type: ignore[operator]


def test_no_top_level_module_outside_the_contract():
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert top == sorted(CONTRACT), "top-level modules outside the contract: " + ", ".join(
        sorted(set(top) - set(CONTRACT)))


def test_no_import_runs_against_the_side_order():
    found = against_the_order(import_graph())
    assert not found, "imports against the side order: " + "; ".join(found)


def test_the_order_check_sees_an_import_from_a_later_side_up():
    graph = {"qreward_queue.flow.limiter": {"qreward_queue.trainer.client"},
             "qreward_queue.config.loader": {"qreward_queue.planning.ensemble"},
             "qreward_queue.config.model": {"qreward_queue.config.loader"}}
    assert against_the_order(graph) == [
        "qreward_queue.config.model -> qreward_queue.config.loader",
        "qreward_queue.flow.limiter -> qreward_queue.trainer.client"]


def test_no_import_circle():
    found = cycles(import_graph())
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


# What only a worker (or an operator's command) needs; a trainer's import loads none of it.
WORKER_ONLY = (
    "qreward_queue.worker",                    # the worker's side: the task, call pool, retries
    "qreward_queue.worker.tasks",
    # (`qreward_queue.backends` and its kind modules are a trainer's too: the config loader
    # asks each kind for its options, samples per call and identity; see backends/base.py)
    "qreward_queue.backends.transport",        # the HTTP sockets and reply parser
    "qreward_queue.backends.function_runner",  # the function backend's helper processes
    "qreward_queue.rewards",                   # reward functions and their sandbox
    "qreward_queue.rewards.sandbox",
    "qreward_queue.ops.metrics",               # the worker's Prometheus counters
    "qreward_queue.ops.exporter",              # the Redis state exporter
    "qreward_queue.testing",                   # the mock judge
    "qreward_queue.cli.main",
    "prometheus_client",
    "httptools",
    "aiohttp",
)
TRAINER_IMPORTS = (
    "from qreward_queue import submit_batch, score, MicroBatcher",
    "import qreward_queue.integrations.verl",
    "import qreward_queue.integrations.trl",
    "import qreward_queue.integrations.openrlhf",
    "import qreward_queue.integrations.slime",
    "import qreward_queue.integrations.areal",
)



@pytest.mark.parametrize("statement", TRAINER_IMPORTS)
def test_a_trainer_import_loads_no_worker_module(statement):
    """In a fresh interpreter, as a trainer (or its framework's reward hook) starts."""
    code = f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True,
                                       text=True, check=True).stdout)
    heavy = sorted(set(loaded) & set(WORKER_ONLY))
    assert not heavy, f"{statement!r} loads {heavy}"
