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
import subprocess
import threading
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
CPU_SHARE = 1.0  # cores a run may use at most (a quota), whatever it forks
_serial = itertools.count()


@dataclass(frozen=True)
class Layout:
    """Where this worker's sample groups go: one parent per hierarchy, and which version."""

    version: int
    parents: tuple[Path, ...]  # v2: one; v1: memory, pids, then cpu and cpuacct if mounted

    @property
    def cpu(self) -> bool:
        """Whether a run's CPU is bounded (a quota) and measured (its usage) here."""
        if self.version == 1:
            return len(self.parents) == 4
        return "cpu" in (self.parents[0].parent / "cgroup.subtree_control").read_text().split()


def _own(hierarchy: str) -> str | None:
    """This process's path in a hierarchy (`memory`, `pids`; "" for v2)."""
    with open("/proc/self/cgroup") as fh:
        for line in fh:
            _, names, path = line.rstrip("\n").split(":", 2)
            if (hierarchy in names.split(",")) if hierarchy else names == "":
                return path
    return None


def _own_dir(hierarchy: str) -> str:
    """This process's group, above any group qrq made (a helper started from a process that
    moved into one puts its own next to it, not inside)."""
    parts = (_own(hierarchy) or "/").strip("/").split("/")
    while parts and parts[-1].startswith("qrq-"):
        parts.pop()
    return "/".join(parts)


def _layout() -> Layout | str:
    """The layout, or why there is none."""
    memory, pids = ROOT / "memory", ROOT / "pids"
    if (memory / "memory.limit_in_bytes").exists() and (pids / "cgroup.procs").exists():
        names = ["memory", "pids"]
        if (ROOT / "cpu" / "cpu.cfs_quota_us").exists() and (ROOT / "cpuacct").is_dir():
            names += ["cpu", "cpuacct"]
        return Layout(1, tuple(ROOT / name / _own_dir(name) for name in names))
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
    try:
        moved = subprocess.run([*group.enter_argv(), "/bin/true"], capture_output=True)
    finally:
        group.destroy()
    if moved.returncode != 0:
        return f"cannot move a process into a cgroup under {layout.parents[0]}"
    return layout


def describe(layout: Layout | str) -> str:
    if isinstance(layout, str):
        return f"rlimits only ({layout})"
    where = f"a cgroup v{layout.version} per sample under {', '.join(map(str, layout.parents))}"
    if not layout.cpu:
        return f"{where} (no cpu controller: CPU shared per process, case limits in wall time)"
    return f"{where}, CPU {CPU_SHARE:g} core per sample, case limits in its CPU time"


class Group:
    """One cgroup (a directory per hierarchy): a run's own, or the calling process's."""

    def __init__(self, layout: Layout, name: str):
        if layout.version == 2:  # a delegated group may need its children's controllers on
            for controller in ("+memory +pids", "+cpu"):
                with contextlib.suppress(OSError):
                    (layout.parents[0] / "cgroup.subtree_control").write_text(controller)
        self.version, self.dirs = layout.version, []
        self.names = ("memory", "pids", "cpu", "cpuacct")[: len(layout.parents)]
        try:
            for parent in layout.parents:
                path = parent / name
                path.mkdir(exist_ok=True)
                self.dirs.append(path)
            self._bound_cpu()
        except OSError:
            self.destroy()
            raise

    def _bound_cpu(self) -> None:
        """At most CPU_SHARE of a core, and one share of the CPU beside other groups: however
        many processes or sessions a run makes (the kernel's autogroup, which gives each
        session a share, applies only outside a cpu cgroup)."""
        if self.version == 2 and (self.dirs[0] / "cpu.max").exists():
            self._write("cpu.max", f"{int(CPU_SHARE * 100_000)} 100000")
        elif "cpu" in self.names:
            period = int(self._path("cpu.cfs_period_us").read_text())
            self._write("cpu.cfs_quota_us", str(int(CPU_SHARE * period)))

    def cpu_clock(self) -> tuple[Path, str, float] | None:
        """(file, key, seconds per unit) of the CPU time used by everything in the group."""
        if self.version == 2:
            return self.dirs[0] / "cpu.stat", "usage_usec", 1e-6
        return (self._path("cpuacct.usage"), "", 1e-9) if "cpuacct" in self.names else None

    def anonymous(self) -> int:
        """Memory charged that the kernel cannot reclaim by dropping page cache."""
        stat = dict(line.split() for line in self._path("memory.stat").read_text().splitlines())
        keys = ("anon", "shmem") if self.version == 2 else ("rss", "shmem")
        return sum(int(stat.get(key, 0)) for key in keys)

    @classmethod
    def create(cls, layout: Layout, memory_bytes: int, pids: int) -> Group:
        """A new group for one run, limited."""
        group = cls(layout, f"qrq-{os.getpid()}-{next(_serial)}")
        try:
            group.limit(memory_bytes, pids)
        except OSError:
            group.destroy()
            raise
        return group

    def limit(self, memory_bytes: int | None, pids: int | None) -> None:
        """Set (None: lift) the memory limit, swap included where accounted, and pids.max."""
        if self.version == 2:
            self._write("memory.max", "max" if memory_bytes is None else str(memory_bytes))
            with contextlib.suppress(FileNotFoundError):
                self._write("memory.swap.max", "max" if memory_bytes is None else "0")
        else:
            value = "-1" if memory_bytes is None else str(memory_bytes)
            try:
                self._write("memory.limit_in_bytes", value)
            except OSError:  # above memsw: that one goes first (v1 keeps memsw >= limit)
                self._write("memory.memsw.limit_in_bytes", value)
                self._write("memory.limit_in_bytes", value)
            with contextlib.suppress(FileNotFoundError):
                self._write("memory.memsw.limit_in_bytes", value)
        self._write("pids.max", "max" if pids is None else str(pids))

    def _path(self, name: str) -> Path:
        if self.version == 2:
            return self.dirs[0] / name
        return self.dirs[self.names.index(name.split(".")[0])] / name

    def _write(self, name: str, value: str) -> None:
        self._path(name).write_text(value)

    def usage(self) -> tuple[int, int]:
        """(memory charged, processes) now."""
        memory = "memory.current" if self.version == 2 else "memory.usage_in_bytes"
        return int(self._path(memory).read_text()), int(self._path("pids.current").read_text())

    def enter_argv(self, enter: bool = True) -> list[str]:
        """argv prefix: a shell that moves itself into every directory of the group (so
        everything the sandbox starts is in it from its start) and makes itself the first
        choice of the out-of-memory killer (not a caller sharing the group), then execs."""
        script = "echo 1000 >/proc/self/oom_score_adj; "
        script += 'for p; do [ "$p" = -- ] && break; echo 0 >"$p" || exit 125; shift; done; '
        script += 'shift; exec "$@"'
        procs = [str(d / "cgroup.procs") for d in self.dirs] if enter else []
        return ["/bin/sh", "-c", script, "sh", *procs, "--"]

    def members(self) -> set[int]:
        return {pid for path in self.dirs for pid in _pids(path)}

    def kill_all(self, but: int | None = None) -> None:
        """SIGKILL every process in the group (but one) and wait until they are gone."""
        kill = self.dirs[0] / "cgroup.kill" if self.dirs else None
        if but is None and kill is not None and kill.exists():
            with contextlib.suppress(OSError):
                kill.write_text("1")
        for _ in range(2000):
            left = [pid for path in self.dirs for pid in _pids(path) if pid != but]
            if not left:
                return
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.0005)

    def destroy(self) -> None:
        """Kill whatever is left in the group, then remove it."""
        self.kill_all()
        for path in self.dirs:
            for _ in range(1000):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # the last process is still exiting
                    time.sleep(0.0005)


_mine: tuple[int, Group | None] | None = None  # (pid, the group of that process)


def for_run(layout: Layout, memory_bytes: int, pids: int) -> tuple[Group, bool]:
    """The group a run goes in, and whether the sandbox must enter it on its way in.

    Moving a process between cgroups makes the next forks and namespaces slow for a while
    (measured ~15 ms per run here), so a single-threaded caller moves itself once into a
    group of its own and the sandbox, started from it, is in it from its first instruction:
    the limits are the caller's own anonymous memory plus the run's budget, lifted after the
    run. A caller with other threads (which could allocate meanwhile), or whose group holds
    other processes (children forked since), gets a new group per run."""
    group = _my_group(layout) if threading.active_count() == 1 else None
    if group is not None and group.members() == {os.getpid()}:
        # the caller's own anonymous memory, not its usage: page cache charged to the group
        # (files earlier runs read) is reclaimable and must not raise this run's bound
        _, processes = group.usage()
        group.limit(group.anonymous() + memory_bytes, processes + pids)
        return group, False
    return Group.create(layout, memory_bytes, pids), True


def _my_group(layout: Layout) -> Group | None:
    """This process's own group, made and entered once (None when it cannot be)."""
    global _mine
    if _mine is None or _mine[0] != os.getpid():
        _remove_stale(layout)
        group: Group | None = None
        with contextlib.suppress(OSError):
            group = Group(layout, f"qrq-{os.getpid()}")
            for path in group.dirs:
                (path / "cgroup.procs").write_text(str(os.getpid()))
        _mine = (os.getpid(), group)
    return _mine[1]


def release(group: Group, entered: bool) -> None:
    """After a run: nothing of it is left; the caller's own group loses its limits."""
    if entered:
        group.destroy()
        return
    group.kill_all(but=os.getpid())  # the group held only the caller before the run
    group.limit(None, None)


def _remove_stale(layout: Layout) -> None:
    """Empty groups of processes that are gone (a killed helper cannot remove its own)."""
    for parent in layout.parents:
        for path in parent.glob("qrq-*"):
            pid = path.name.split("-")[1]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                with contextlib.suppress(OSError):
                    path.rmdir()


def _pids(path: Path) -> list[int]:
    try:
        return [int(x) for x in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []
