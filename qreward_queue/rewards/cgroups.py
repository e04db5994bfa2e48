"""A cgroup per sandboxed run, so memory (tmpfs included) and process count are bounded for
the whole sample, whatever it forks.

Where: a child of the worker's own cgroup, in cgroup v2 (`memory.max`, `memory.swap.max`,
`pids.max`) or in the v1 `memory` and `pids` hierarchies (`memory.limit_in_bytes`,
`memory.memsw.limit_in_bytes` when swap is accounted, `pids.max`). The sandbox enters it
before it starts (a shell writes its own pid into `cgroup.procs`, then execs), and after the
run every process left in it is killed and the group removed. `available()` says whether
this worker may create one here; when it may not, the sandbox falls back to rlimits that
still bound the total (see sandbox.py).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
_serial = itertools.count()


@dataclass(frozen=True)
class Layout:
    """Where this worker's sample groups go: one parent per hierarchy, and which version."""

    version: int
    parents: tuple[Path, ...]  # v2: one; v1: memory, pids


def _own(hierarchy: str) -> str | None:
    """This process's path in a hierarchy (`memory`, `pids`; "" for v2)."""
    with open("/proc/self/cgroup") as fh:
        for line in fh:
            _, names, path = line.rstrip("\n").split(":", 2)
            if (hierarchy in names.split(",")) if hierarchy else names == "":
                return path
    return None


def _own_dir(hierarchy: str) -> str:
    return (_own(hierarchy) or "/").lstrip("/")


def _layout() -> Layout | str:
    """The layout, or why there is none."""
    memory, pids = ROOT / "memory", ROOT / "pids"
    if (memory / "memory.limit_in_bytes").exists() and (pids / "cgroup.procs").exists():
        return Layout(1, (memory / _own_dir("memory"), pids / _own_dir("pids")))
    for v2 in (ROOT, ROOT / "unified"):
        controllers = v2 / "cgroup.controllers"
        if controllers.exists() and {"memory", "pids"} <= set(controllers.read_text().split()):
            return Layout(2, (v2 / _own_dir(""),))
    return "no cgroup v2 with memory and pids controllers, nor v1 memory and pids hierarchies"


@cache
def available() -> Layout | str:
    """The layout when a sample group can be made, limited and removed here; else why not."""
    layout = _layout()
    if isinstance(layout, str):
        return layout
    try:
        group = Group.create(layout, memory_bytes=64 * 2**20, pids=8)
    except OSError as exc:
        return f"cannot create a cgroup under {layout.parents[0]}: {exc.strerror or exc}"
    group.destroy()
    return layout


def describe(layout: Layout | str) -> str:
    if isinstance(layout, str):
        return f"rlimits only ({layout})"
    return f"a cgroup v{layout.version} per sample under {', '.join(map(str, layout.parents))}"


class Group:
    """One sample's cgroup (one directory per hierarchy)."""

    def __init__(self, dirs: list[Path]):
        self.dirs = dirs

    @classmethod
    def create(cls, layout: Layout, memory_bytes: int, pids: int) -> Group:
        name = f"qrq-{os.getpid()}-{next(_serial)}"
        if layout.version == 2:  # a delegated group may need its children's controllers on
            with contextlib.suppress(OSError):
                (layout.parents[0] / "cgroup.subtree_control").write_text("+memory +pids")
        group = cls([])
        try:
            for parent in layout.parents:
                path = parent / name
                path.mkdir()
                group.dirs.append(path)
            if layout.version == 2:
                (group.dirs[0] / "memory.max").write_text(str(memory_bytes))
                with contextlib.suppress(FileNotFoundError):
                    (group.dirs[0] / "memory.swap.max").write_text("0")
                (group.dirs[0] / "pids.max").write_text(str(pids))
            else:
                (group.dirs[0] / "memory.limit_in_bytes").write_text(str(memory_bytes))
                with contextlib.suppress(FileNotFoundError):
                    (group.dirs[0] / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
                (group.dirs[1] / "pids.max").write_text(str(pids))
        except OSError:
            group.destroy()
            raise
        return group

    def enter_argv(self) -> list[str]:
        """argv prefix: a shell that moves itself into every directory of the group, then
        execs the rest (so everything the sandbox starts is in the group from its start)."""
        script = 'for p; do [ "$p" = -- ] && break; echo 0 >"$p" || exit 125; shift; done; '
        script += 'shift; exec "$@"'
        return ["/bin/sh", "-c", script, "sh", *(str(d / "cgroup.procs") for d in self.dirs), "--"]

    def destroy(self) -> None:
        """Kill whatever is left in the group, then remove it."""
        for path in self.dirs:
            kill = path / "cgroup.kill"
            if kill.exists():
                with contextlib.suppress(OSError):
                    kill.write_text("1")
        for _ in range(200):
            left = [pid for path in self.dirs for pid in _pids(path)]
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)
        for path in self.dirs:
            for _ in range(100):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # the last process is still exiting
                    time.sleep(0.005)


def _pids(path: Path) -> list[int]:
    try:
        return [int(x) for x in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []
