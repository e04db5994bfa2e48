"""Runs inside the sandbox (stdlib only): every test case of one program, one fork per case.

Reads a JSON spec on stdin, prepares itself (private tmp, rlimits, an unprivileged uid when it
starts as root), then forks one child per test case: the child gets the case's input on stdin,
its own process group, a CPU limit, and runs the program; the harness collects what it printed
(capped) or returned, and kills the child's group when the case is over or over its time.
Expected outputs never enter the sandbox: a program cannot read them from memory; the caller
compares. Writes one JSON object per case to stdout, one per line.
"""

import contextlib
import ctypes
import json
import os
import resource
import select
import signal
import sys
import time
import traceback

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38


def prepare(spec):
    """Private tmp (unshare mode), a work dir, rlimits, then drop root for good."""
    libc = ctypes.CDLL(None, use_errno=True)
    if spec.get("mount_tmp") and libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, b"size=64m") != 0:
        raise OSError(ctypes.get_errno(), "mounting a private /tmp failed")
    work = spec["work"]
    os.makedirs(work, exist_ok=True)
    uid = spec.get("uid")
    if uid is not None and os.getuid() == 0:
        os.chown(work, uid, uid)
    os.chdir(work)
    limits = spec["limits"]
    for name, value in (
        ("RLIMIT_AS", limits["memory_mb"] * 2**20),
        ("RLIMIT_NPROC", limits["processes"]),
        ("RLIMIT_FSIZE", limits["file_mb"] * 2**20),
        ("RLIMIT_NOFILE", limits["open_files"]),
        ("RLIMIT_CORE", 0),
    ):
        resource.setrlimit(getattr(resource, name), (value, value))
    if uid is not None and os.getuid() == 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # a test case may not ptrace the harness


def run_case(spec, case, index):
    """Fork, run one case in the child, collect its output in the parent."""
    in_path = f"in{index}"
    with open(in_path, "w") as fh:
        fh.write(case.get("input", ""))
    out_r, out_w = os.pipe()
    res_r, res_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(out_r)
        os.close(res_r)
        child(spec, case, in_path, out_w, res_w)
    os.close(out_w)
    os.close(res_w)
    outcome = collect(pid, out_r, res_r, spec["case_s"], spec["output_bytes"])
    os.close(out_r)
    os.close(res_r)
    return outcome


def child(spec, case, in_path, out_w, res_w):
    """The test case's process: never returns."""
    code = 1
    try:
        os.setpgid(0, 0)
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        cpu = int(spec["case_s"]) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        stdin = os.open(in_path, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.dup2(out_w, 1)
        err = os.open("stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(err, 2)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        namespace = {"__name__": "__main__" if "fn_name" not in case else "solution"}
        try:
            exec(compile(spec["code"], "<solution>", "exec"), namespace)
            if "fn_name" in case:
                value = call(namespace, case)
                os.write(res_w, json.dumps(value).encode())
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc(limit=-3)
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def call(namespace, case):
    """Call the case's function: top level, or a method of LeetCode's `Solution`."""
    name = case["fn_name"]
    target = namespace.get(name)
    if target is None and "Solution" in namespace:
        target = getattr(namespace["Solution"](), name, None)
    if not callable(target):
        raise NameError(f"no function {name!r} defined")
    return target(*case.get("args", []))


def collect(pid, out_r, res_r, case_s, cap):
    """Read the child's stdout (capped) until it exits or runs out of time; kill its group."""
    started = time.monotonic()
    chunks, size, status = [], 0, None
    open_fds = [out_r, res_r]
    result = b""
    while open_fds:
        left = started + case_s - time.monotonic()
        if left <= 0:
            status = "timeout"
            break
        ready, _, _ = select.select(open_fds, [], [], left)
        for fd in ready:
            data = os.read(fd, 65536)
            if not data:
                open_fds.remove(fd)
            elif fd == out_r:
                chunks.append(data)
                size += len(data)
            else:
                result += data[: cap - len(result)]
        if size > cap:
            status = "output_limit"
            break
    with contextlib.suppress(ProcessLookupError):  # the case and whatever it left running
        os.killpg(pid, signal.SIGKILL)
    _, wait_status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(wait_status)
    out = {"status": status, "exit": code, "s": round(time.monotonic() - started, 3)}
    out["stdout"] = b"".join(chunks)[:cap].decode("utf-8", "replace")
    if result:
        out["result"] = result.decode("utf-8", "replace")
    if status is None:
        out["status"] = "ok" if code == 0 else "error"
        if code != 0:
            out["error"] = describe(code)
    return out


def describe(code):
    try:
        with open("stderr", "rb") as fh:
            tail = fh.read()[-600:].decode("utf-8", "replace").strip()
    except OSError:
        tail = ""
    head = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    return f"{head}: {tail}" if tail else head


def main():
    spec = json.loads(sys.stdin.read())
    prepare(spec)
    timed_out = False
    for index, case in enumerate(spec["tests"]):
        if timed_out:  # a program that hung once would hang again: skip its remaining cases
            outcome = {"status": "skipped", "error": "not run: an earlier case timed out"}
        else:
            outcome = run_case(spec, case, index)
            timed_out = outcome["status"] == "timeout"
        print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main()
