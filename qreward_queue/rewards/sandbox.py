"""A throwaway sandbox per run for untrusted programs (generated code), with test cases.

Isolation, best first (probed once per process, `pick_mechanism()` says which one runs):
- `bwrap` (bubblewrap, Debian package `bubblewrap`): new PID, network, IPC, UTS and mount
  namespaces (and a user namespace when not root); the filesystem is only /usr (and the
  Python prefix) read-only, an empty /dev, and a private tmpfs /tmp; no /proc, no network
  (not even the host's 127.0.0.1); `--die-with-parent`, `--new-session`.
- `unshare` (util-linux): the same namespaces, a private tmpfs on /tmp, the host's other
  directories visible but only with an unprivileged uid's rights.
- `unsafe`: no namespaces at all; only with an explicit opt-in (`unsafe=True`), never picked
  silently. Without bwrap or unshare and without the opt-in, a run raises SandboxUnavailable.
In all cases: rlimits on address space, processes, file size, open files and CPU per test
case; an unprivileged uid of its own when qrq runs as root (so RLIMIT_NPROC holds); an empty
environment (no API keys); output capped; every case killed with its process group at its
time limit and the whole sandbox at the run's wall clock.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

HARNESS = (Path(__file__).parent / "_harness.py").read_text()
MECHANISMS = ("bwrap", "unshare")
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp"}
UID_BASE = 100_000  # root runs each sandbox as uid UID_BASE + (pid of the caller)


class SandboxUnavailable(RuntimeError):
    """Neither bwrap nor unshare can isolate a run here, and `unsafe` was not asked for."""


@dataclass(frozen=True)
class Limits:
    """Limits of one sandboxed run (all test cases of one program)."""

    time_s: float = 10.0  # wall clock of the whole run
    case_s: float = 2.0  # wall clock of one test case (its CPU limit is this + 1 s)
    memory_mb: int = 512  # address space of each process
    processes: int = 32
    file_mb: int = 16
    open_files: int = 64
    output_bytes: int = 1 << 20  # stdout kept per case; more kills the case


@dataclass
class Run:
    """What came back: one dict per case (status ok/error/timeout/output_limit/skipped,
    stdout, result (JSON text) for call-based cases, exit, error), and how the run went."""

    cases: list[dict] = field(default_factory=list)
    mechanism: str = ""
    wall_s: float = 0.0
    timed_out: bool = False


def _python() -> str:
    return os.path.realpath(sys.executable)


def _binds() -> list[str]:
    """Read-only system directories: /usr, the top-level links into it, the Python prefix."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/lib", "/lib64", "/lib32", "/sbin"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    prefix = os.path.realpath(sys.base_prefix)
    if not prefix.startswith("/usr/"):
        args += ["--ro-bind", prefix, prefix]
    return args


def command(mechanism: str) -> tuple[list[str], dict]:
    """The argv running the harness under `mechanism`, and what the harness must set up."""
    root = os.getuid() == 0
    setup: dict = {"uid": UID_BASE + os.getpid() if root else None, "work": "/tmp/work"}
    python = [_python(), "-I", "-S", "-c", HARNESS]  # -S: stdlib only, 90 ms faster
    if mechanism == "bwrap":
        # as root, no user namespace: it would map the sandbox to uid 0, where RLIMIT_NPROC
        # does not apply; the harness drops to its own uid instead
        spaces = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
        spaces += ["--unshare-cgroup-try"] if root else ["--unshare-all"]
        argv = ["bwrap", *spaces, "--die-with-parent", "--new-session", *_binds()]
        argv += ["--dev", "/dev", "--tmpfs", "/tmp", "--chdir", "/tmp", "--clearenv"]
        for key, value in ENV.items():
            argv += ["--setenv", key, value]
        return argv + python, setup
    if mechanism == "unshare":
        argv = ["unshare", "--net", "--pid", "--fork", "--ipc", "--uts", "--mount"]
        argv += ["--kill-child"] + ([] if root else ["--user", "--map-root-user"])
        return argv + python, {**setup, "mount_tmp": True}
    if mechanism == "unsafe":
        return python, {**setup, "work": None}
    raise ValueError(f"unknown sandbox mechanism {mechanism!r}")


@cache
def probe(mechanism: str) -> str | None:
    """None when `mechanism` runs a program here, else why not (cached per process)."""
    tool = "bwrap" if mechanism == "bwrap" else "unshare"
    if shutil.which(tool) is None:
        return f"{tool} is not installed"
    try:
        run = run_cases(
            "print(6 * 7)", [{"input": ""}], Limits(time_s=20, case_s=10), mechanism=mechanism
        )
    except OSError as exc:
        return f"{tool} failed: {exc}"
    case = run.cases[0] if run.cases else {}
    if case.get("stdout", "").strip() != "42":
        return f"{tool} cannot run a program here: {case.get('error') or run}"[:300]
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


def run_cases(
    code: str,
    cases: list[dict],
    limits: Limits = Limits(),
    mechanism: str | None = None,
    unsafe: bool = False,
) -> Run:
    """Run `code` against each case ({"input": str} or {"fn_name", "args"}) in one sandbox."""
    chosen = mechanism or pick_mechanism(unsafe)
    argv, setup = command(chosen)
    work = setup["work"] or tempfile.mkdtemp(prefix="qrq-sandbox-")
    spec = {**setup, "work": work, "code": code, "tests": cases, "limits": asdict(limits)}
    spec.update(case_s=limits.case_s, output_bytes=limits.output_bytes)
    started = time.monotonic()
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
        start_new_session=True,
    )
    timed_out = False
    try:
        out, err = proc.communicate(json.dumps(spec).encode(), timeout=limits.time_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    finally:
        if setup["work"] is None:
            shutil.rmtree(work, ignore_errors=True)
    run = Run(mechanism=chosen, wall_s=time.monotonic() - started, timed_out=timed_out)
    for line in out.decode("utf-8", "replace").splitlines():
        with contextlib.suppress(ValueError):
            run.cases.append(json.loads(line))
    why = (
        f"the run went over its {limits.time_s:g} s limit"
        if timed_out
        else f"the sandbox ended early: {err.decode('utf-8', 'replace').strip()[-300:]}"
    )
    for _ in range(len(run.cases), len(cases)):
        run.cases.append({"status": "timeout" if timed_out else "error", "error": why})
    return run
