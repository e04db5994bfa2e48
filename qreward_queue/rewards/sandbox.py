"""A throwaway sandbox per run for untrusted programs (generated code), with test cases.

Isolation, best first (probed once per process, `pick_mechanism()` says which one runs):
- `bwrap` (bubblewrap, Debian package `bubblewrap`): new PID, network, IPC, UTS and mount
  namespaces (and a user namespace when not root); the filesystem is only /usr and the
  Python prefix read-only (installed packages hidden), a few device nodes, size-capped
  private tmpfs /tmp and /dev/shm, the rest read-only; no /proc, no network (not even the
  host's 127.0.0.1); `--die-with-parent`.
- `unshare` (util-linux): the same namespaces; the harness builds the same filesystem itself
  (a read-only tmpfs root, system directories bound read-only, pivot_root: the host's tree,
  /proc, /run and /dev/shm are gone).
- `unsafe`: no namespaces at all; only with an explicit opt-in (`unsafe=True`), never picked
  silently. Without bwrap or unshare and without the opt-in, a run raises SandboxUnavailable.
In all cases each test case runs in its own PID namespace (nothing it starts outlives it, it
cannot see the harness), unprivileged (its own uid when qrq runs as root, else no
capabilities), under a seccomp filter, with rlimits, an empty environment and capped output.
Memory (tmpfs included) and processes are bounded for the whole run by a cgroup where the
worker may create one (`cgroups.py`); elsewhere a case may not start other processes or
threads, so RLIMIT_AS plus the tmpfs sizes bound the total.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import json
import marshal
import os
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from functools import cache, lru_cache
from pathlib import Path

from . import cgroups

HARNESS = (Path(__file__).parent / "_harness.py").read_text()
MECHANISMS = ("bwrap", "unshare")
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp"}
UID_BASE = 100_000  # as root, a run's cases get uid UID_BASE + 16 x (caller's pid) + k
_runs = itertools.count()  # k: concurrent runs of one caller do not share RLIMIT_NPROC
SHM_MB = 16  # size of the private /dev/shm
OVERHEAD_MB = 96  # the cgroup's room for the harness and the sandbox's own processes
GRACE_S = 10.0  # beyond the run's own limits before the host gives up on the harness
PROBE = "import heapq, bisect, collections, itertools, functools, math, re, json, fractions\n"
PROBE += "import decimal, random, string, datetime, statistics, typing, array, copy\nprint(6 * 7)"


class SandboxUnavailable(RuntimeError):
    """Neither bwrap nor unshare can isolate a run here, and `unsafe` was not asked for."""


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): the sample must not get a score."""


@dataclass(frozen=True)
class Limits:
    """Limits of one sandboxed run (all test cases of one program)."""

    time_s: float = 10.0  # the program's time for all its cases; cases beyond it fail
    # CPU time of one test case, all its processes (where a cgroup measures it: time other
    # programs take from it does not count; its wall clock may run to case_wall_s); else
    # its wall clock. Each process's own CPU limit is this + 1 s.
    case_s: float = 2.0
    memory_mb: int = 512  # address space of each process; with a cgroup, of the whole run
    processes: int = 32  # with a cgroup, per run; without one, a case runs alone
    file_mb: int = 16
    disk_mb: int = 64  # the private /tmp (the run's only writable directory)
    open_files: int = 64
    output_bytes: int = 1 << 20  # stdout kept per case; more ends the case
    loopback: bool = False  # TCP/UDP on the run's own 127.0.0.1 (else AF_UNIX sockets only)


def case_wall_s(case_s: float) -> float:
    """The wall clock a case may take when its CPU time is what counts (a sleep, a blocked
    read, or CPU given to others)."""
    return 2 * case_s + 1


def bound_s(limits: Limits) -> float:
    """How long one sandbox may take before the host gives up on it (a SandboxError)."""
    return limits.time_s + case_wall_s(limits.case_s) + GRACE_S


@dataclass
class Run:
    """What came back: one dict per case (status ok/error/timeout/output_limit/skipped,
    stdout, result (JSON text) for call-based cases, exit, error), and how the run went."""

    cases: list[dict] = field(default_factory=list)
    mechanism: str = ""
    wall_s: float = 0.0
    restarts: int = 0


def _python() -> str:
    return os.path.realpath(sys.executable)


def _system_paths() -> list[str]:
    """What a program may read: /usr, the top-level links into it, the Python prefix."""
    paths = ["/usr", "/bin", "/lib", "/lib64", "/lib32", "/sbin"]
    prefix = os.path.realpath(sys.base_prefix)
    if not prefix.startswith("/usr/"):
        paths.append(prefix)
    return [p for p in paths if os.path.lexists(p)]


@cache
def _hidden_paths() -> list[str]:
    """Every site or dist directory of the interpreter (`*-packages` under a `lib*/python*`
    of its prefix, /usr or /usr/local, and whatever sysconfig and site name): installed
    packages are not the program's to read (a data set or a test suite may ship in one),
    and `-I -S` keeps them off its path anyway. Found once per process (~15 ms)."""
    roots = {os.path.realpath(sys.base_prefix), "/usr", "/usr/local"}
    found = {p for root in roots for p in glob.glob(f"{root}/lib*/python*/*-packages")}
    for scheme in sysconfig.get_scheme_names():
        for root in roots:
            for kind in ("purelib", "platlib"):
                with contextlib.suppress(KeyError, ValueError):
                    vars_ = {"base": root, "platbase": root, "userbase": root}
                    found.add(sysconfig.get_path(kind, scheme, vars=vars_))
    found.update(site.getsitepackages([sys.base_prefix, *roots]))
    shown = _system_paths()
    return sorted(
        p for p in map(os.path.realpath, found)
        if os.path.isdir(p) and any(p == s or p.startswith(s + "/") for s in shown)
    )


def _bwrap_binds() -> list[str]:
    args: list[str] = []
    made = set()
    for path in _system_paths():
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
            continue
        for parent in reversed(Path(path).parents[:-1]):  # enterable, whatever the host's are
            if parent not in made:
                made.add(parent)
                args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", path, path]
    for path in _hidden_paths():
        args += ["--tmpfs", path, "--remount-ro", path]
    return args


def command(mechanism: str, limits: Limits, group: bool) -> tuple[list[str], dict]:
    """The argv running the harness under `mechanism`, and what the harness must set up."""
    root = os.getuid() == 0
    userns = not root and mechanism != "unsafe"
    processes = limits.processes if group else 1
    setup: dict = {
        "uid": UID_BASE + 16 * os.getpid() + next(_runs) % 16 if root else None,
        "work": "/tmp/work",
        # the case's init counts; in a user namespace also the harness and bwrap's or
        # unshare's own process
        "nproc": processes + 1 + (2 if userns else 0),
        # without a group: threads, no processes (a seccomp filter refuses fork)
        "threads": 0 if group else limits.processes,
        "pidns": mechanism != "unsafe" or root,
        "drop": "uid" if root else "caps" if userns else None,
        "tmpfs": {} if mechanism == "unsafe" else {"/tmp": limits.disk_mb, "/dev/shm": SHM_MB},
    }
    # -S: stdlib only, 90 ms faster; the harness comes compiled, first on stdin (compiling
    # its source took 6 ms a run)
    boot = "import marshal, os\nb = b''\nwhile len(b) < %d:\n    b += os.read(0, %d - len(b))\n"
    boot += "exec(marshal.loads(b))"
    size = len(_compiled(HARNESS))
    python = [_python(), "-I", "-S", "-c", boot % (size, size)]
    if mechanism == "bwrap":
        # as root, no user namespace (it would map the sandbox to uid 0): the case drops to
        # its own uid instead; as a user, root of a user namespace with capabilities there,
        # which the case drops
        spaces = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
        as_user = ["--unshare-all", "--uid", "0", "--gid", "0", "--cap-add", "ALL"]
        spaces += ["--unshare-cgroup-try"] if root else as_user
        argv = ["bwrap", *spaces, "--die-with-parent", "--new-session", *_bwrap_binds()]
        # /tmp and /dev/shm: mount points, the harness mounts a fresh tmpfs there per case
        argv += ["--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/dev/shm", "--remount-ro", "/"]
        argv += ["--chdir", "/", "--clearenv"]
        for key, value in ENV.items():
            argv += ["--setenv", key, value]
        return argv + python, setup
    if mechanism == "unshare":
        argv = ["unshare", "--net", "--pid", "--fork", "--ipc", "--uts", "--mount"]
        argv += ["--kill-child"] + ([] if root else ["--user", "--map-root-user"])
        setup["root"] = {"at": "/tmp", "binds": _system_paths(), "hide": _hidden_paths()}
        return argv + python, setup
    if mechanism == "unsafe":
        return python, {**setup, "work": None, "nproc": limits.processes + 1, "threads": 0}
    raise ValueError(f"unknown sandbox mechanism {mechanism!r}")


@cache
def probe(mechanism: str) -> str | None:
    """None when `mechanism` runs a program importing the usual standard modules here, else
    why not (cached per process)."""
    tool = "bwrap" if mechanism == "bwrap" else "unshare"
    if shutil.which(tool) is None:
        return f"{tool} is not installed"
    try:
        run = run_cases(PROBE, [{"input": ""}], Limits(time_s=20, case_s=10), mechanism=mechanism)
    except (OSError, SandboxError) as exc:
        return f"{tool} failed: {exc}"[:300]
    case = run.cases[0] if run.cases else {}
    if case.get("stdout", "").strip() != "42":
        last = (str(case.get("error") or case).strip().splitlines() or [""])[-1]
        return f"{tool} cannot run a program importing the standard library here: {last}"[:300]
    return None


def pick_mechanism(unsafe: bool = False) -> str:
    """The best isolation available: bwrap, else unshare, else `unsafe` if allowed."""
    reasons = []
    for name in MECHANISMS:
        why = probe(name)
        if why is None:
            return name
        reasons.append(why)
    if unsafe:
        return "unsafe"
    raise SandboxUnavailable(
        "no sandbox for generated code: " + "; ".join(reasons) + ". Install bubblewrap "
        "(apt-get install bubblewrap) or allow user namespaces, or opt in with unsafe=True."
    )


def describe(unsafe: bool = False) -> str:
    """One line for a pool's start: the mechanism and how the whole sample is bounded
    (raises SandboxUnavailable when no program can run here)."""
    mechanism = pick_mechanism(unsafe)
    if mechanism == "unsafe":
        return "code sandbox: NONE (unsafe=true): generated code runs without isolation"
    layout = cgroups.available()
    how = cgroups.describe(layout)
    if isinstance(layout, str):
        how += "; a test case may start threads but not processes"
    return f"code sandbox: {mechanism}, memory and processes bounded by {how}"


@lru_cache(maxsize=4)
def _compiled(source: str) -> bytes:
    """The harness as a code object for this interpreter (marshal: same binary inside)."""
    return marshal.dumps(compile(source, "<qrq-harness>", "exec"))


def _frame(document: object) -> bytes:
    data = json.dumps(document).encode()
    return b"%010d" % len(data) + data


def run_cases(
    code: str,
    cases: list[dict],
    limits: Limits = Limits(),
    mechanism: str | None = None,
    unsafe: bool = False,
) -> Run:
    """Run `code` against each case ({"input": str} or {"fn_name", "args"}) in one sandbox;
    a sandbox killed during a case (e.g. at the run's memory limit) fails that case and the
    rest run in a fresh one. SandboxError when the sandbox itself fails."""
    chosen = mechanism or pick_mechanism(unsafe)
    run = Run(mechanism=chosen)
    started = time.monotonic()
    while len(run.cases) < len(cases):
        spent = time.monotonic() - started
        budget = limits.time_s - spent if run.cases else limits.time_s
        if budget <= 0:
            why = f"not run: the program used up the run's {limits.time_s:g} s"
            run.cases += [{"status": "skipped", "error": why}] * (len(cases) - len(run.cases))
            break
        with_budget = Limits(**{**asdict(limits), "time_s": budget})
        got = _one_sandbox(code, cases[len(run.cases) :], with_budget, chosen)
        run.cases += got
        run.restarts += len(run.cases) < len(cases)
    run.wall_s = time.monotonic() - started
    return run


def _one_sandbox(code: str, cases: list[dict], limits: Limits, mechanism: str) -> list[dict]:
    """Outcomes of the cases this sandbox got through (all, unless it was killed mid-case)."""
    layout = cgroups.available()
    group, enter = None, False
    if not isinstance(layout, str):
        memory = (limits.memory_mb + limits.disk_mb + SHM_MB + OVERHEAD_MB) << 20
        group, enter = cgroups.for_run(layout, memory, limits.processes + 8)
    argv, setup = command(mechanism, limits, group is not None)
    work = setup["work"] or tempfile.mkdtemp(prefix="qrq-sandbox-")
    spec = {**setup, "work": work, "code": code, "cases": len(cases), "limits": asdict(limits)}
    spec["case_wall_s"] = case_wall_s(limits.case_s)  # where the harness measures CPU time
    clock = group.cpu_clock() if group is not None else None
    if clock is not None:  # the harness reads the run's CPU time through this descriptor
        spec["cpu"] = {"fd": os.open(clock[0], os.O_RDONLY), "key": clock[1], "unit": clock[2]}
    message = _compiled(HARNESS) + _frame(spec) + b"".join(_frame(case) for case in cases)
    try:
        proc = subprocess.Popen(
            (group.enter_argv(enter) if group else []) + argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=ENV,
            start_new_session=True,
            pass_fds=(spec["cpu"]["fd"],) if "cpu" in spec else (),
        )
        limit_s = bound_s(limits)
        try:
            out, err = proc.communicate(message, timeout=limit_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            why = f"the sandbox ({mechanism}) did not finish within {limit_s:g} s"
            raise SandboxError(why) from None
    finally:
        if "cpu" in spec:
            os.close(spec["cpu"]["fd"])
        if group is not None:
            cgroups.release(group, enter)
        if setup["work"] is None:
            shutil.rmtree(work, ignore_errors=True)
    calls = ["fn_name" in case for case in cases]
    return _outcomes(out, err, proc.returncode, calls, mechanism)


def _messages(out: bytes, mechanism: str) -> Iterator[tuple[dict, bytes]]:
    """The harness's JSON lines, each with the raw output that follows an outcome."""
    at = 0
    while at < len(out):
        end = out.find(b"\n", at)
        end = len(out) if end < 0 else end
        line, at = out[at:end], end + 1
        try:
            message = json.loads(line)
        except ValueError:
            raise SandboxError(f"the sandbox ({mechanism}) wrote {line[:100]!r}") from None
        size = message.pop("bytes", 0) if isinstance(message, dict) else 0
        yield message, out[at : at + size]
        at += size


def _outcomes(out: bytes, err: bytes, code: int, calls: list[bool], mechanism: str) -> list[dict]:
    """One outcome per case the harness got through; `calls` says which cases are calls."""
    ready, running, n = False, None, len(calls)
    outcomes: list[dict] = []
    for message, output in _messages(out, mechanism):
        if "fatal" in message:
            raise SandboxError(f"the sandbox ({mechanism}) could not start: {message['fatal']}")
        if "ready" in message:
            ready = True
        elif "start" in message:
            running = message["start"]
        else:
            text = output.decode("utf-8", "replace")
            message["stdout"] = "" if calls[len(outcomes)] else text
            if calls[len(outcomes)] and text:
                message["result"] = text
            outcomes.append(message)
            running = None
    if len(outcomes) == n:
        return outcomes
    tail = err.decode("utf-8", "replace").strip()[-300:] or f"exit code {code}"
    if not ready or running is None:  # not during a case: the sandbox's own fault
        raise SandboxError(f"the sandbox ({mechanism}) ended early: {tail}")
    why = f"the sandbox was killed while this case ran (the run's memory or processes?): {tail}"
    return [*outcomes, {"status": "error", "error": why}]
