"""Runs inside the sandbox (stdlib only): every test case of one program, one process per case.

Protocol on stdin: frames of 10 ASCII digits (the length) and a JSON document: first the
spec (code, limits, how to set up), then one case at a time ({"input"} or {"fn_name",
"args"}), read only when that case starts: no later case's input is ever in memory a program
could read. On stdout, one JSON line each: {"ready": ...} once set up (or {"fatal": why}),
{"start": k} as case k starts, then the case's outcome followed by its raw output (stdout,
or the JSON a call returned), `"bytes"` long.

The harness keeps its privileges (root, or root of its own user namespace) and never touches
a path after set-up. Each case gets a PID namespace of its own whose pid 1 (the case's init)
drops privileges (its own uid, or no capabilities at all), loads a seccomp filter and starts
the program as pid 2: the program cannot see, signal or ptrace the harness, and when the init
ends the kernel kills everything the program started. Its input is a memfd, its output
pipes, its /tmp and /dev/shm fresh tmpfs. Expected outputs never enter the sandbox.
"""

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import resource
import select
import signal
import sys
import time
import traceback

CLONE_NEWPID, CLONE_NEWIPC, SYS_CLONE = 0x20000000, 0x08000000, 56  # x86_64
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP = 1, 4, 24
PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER, PR_CAP_AMBIENT = 27, 38, 36, 47
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 32, 4096, 16384
MNT_DETACH = 2
INODES = 16384  # files per private tmpfs: empty files cost memory that size= does not count
DEVICES = ("null", "zero", "full", "random", "urandom")
libc = ctypes.CDLL(None, use_errno=True)


NEW_NAMESPACES = (0x80, 0x20000, 0x2000000, 0x4000000, 0x8000000, 0x10000000, 0x20000000,
                  0x40000000)  # CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, ...
DENIED = (  # a program needs none of these; each would let it step around the limits
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "ptrace", "keyctl",
    "add_key", "request_key", "bpf", "userfaultfd", "perf_event_open", "open_by_handle_at",
    "io_uring_setup", "fsopen", "fsmount", "fsconfig", "open_tree", "move_mount",
    "mount_setattr",
    "setsid", "setpgid",  # a session or group of its own: one more CPU share (autogroup)
    "shmget", "memfd_create",  # memory outside the address space and the tmpfs sizes
)
AF_UNIX, AF_INET, AF_INET6, CLONE_THREAD = 1, 2, 10, 0x10000
SCMP_ACT_ALLOW, SCMP_ACT_ERRNO, SCMP_CMP_MASKED_EQ = 0x7FFF0000, 0x00050000, 7


class ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64),
                ("b", ctypes.c_uint64)]


def equal_int(arg, value):
    """An int argument equals `value` (its upper 32 bits, which the kernel ignores, masked)."""
    return ArgCmp(arg, SCMP_CMP_MASKED_EQ, 0xFFFFFFFF, value)


def seccomp():
    """libseccomp, or None when it is not installed."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        return None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(ArgCmp)
    ]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    return lib


def seccomp_filter(lib, rules):
    """A filter allowing everything but `rules`: (syscall, errno, argument comparisons...)."""
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    for name, err, *compare in rules:
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number >= 0:
            array = (ArgCmp * max(1, len(compare)))(*compare)
            action = SCMP_ACT_ERRNO | err
            rule = lib.seccomp_rule_add_array(ctx, action, number, len(compare), array)
            check(rule, f"seccomp rule for {name}")
    return lib, ctx


def syscall_filter(lib, loopback):
    """Refuses new namespaces (a user namespace would let a program mount a tmpfs of its
    own), mounts, ptrace, keyrings, bpf, new sessions, SysV and memfd memory, and every
    socket family but AF_UNIX (and AF_INET/AF_INET6 on the run's own loopback when asked
    for): vsock and the other families no network namespace separates are refused."""
    rules = [(name, errno.EPERM) for name in DENIED]
    rules.append(("clone3", errno.ENOSYS))  # the C library falls back to clone: flags seen
    rules += [("clone", errno.EPERM, ArgCmp(0, SCMP_CMP_MASKED_EQ, f, f)) for f in NEW_NAMESPACES]
    allowed = {AF_UNIX, AF_INET, AF_INET6} if loopback else {AF_UNIX}
    for family in sorted(set(range(64)) - allowed):  # AF_MAX is 46
        for call in ("socket", "socketpair"):
            rules.append((call, errno.EAFNOSUPPORT, equal_int(0, family)))
    return seccomp_filter(lib, rules)


def process_filter(lib):
    """Threads but no new processes (where no cgroup bounds a run, each process would get
    an address space of its own)."""
    no_thread = ArgCmp(0, SCMP_CMP_MASKED_EQ, CLONE_THREAD, 0)
    rules = [("fork", errno.EAGAIN), ("vfork", errno.EAGAIN), ("clone", errno.EAGAIN, no_thread)]
    return seccomp_filter(lib, rules)


class SandboxFault(Exception):
    """The harness cannot run a case: the host reports the sample as an error."""


def check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def read_frame():
    """One frame from stdin, read without buffering ahead."""
    head = read_exactly(10)
    return json.loads(read_exactly(int(head))) if head else None


def read_exactly(n):
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def prepare(spec):
    """The unshare mechanism's own root; the harness's own protections."""
    if spec.get("root"):
        build_root(spec["root"])
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # a case's first process comes back to us
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    lib = seccomp()
    spec["filter"] = lib and syscall_filter(lib, spec["limits"]["loopback"])
    spec["no_fork"] = lib and spec["threads"] and process_filter(lib)
    if spec["no_fork"]:  # threads count against RLIMIT_NPROC too
        spec["nproc"] += spec["threads"]
    fresh_directories(spec, first=True)


def fresh_directories(spec, first=False):
    """Empty writable directories for the next case (new size-capped tmpfs mounts: nothing
    an earlier case wrote is left, and the harness never walks what a program made). A
    tmpfs counts every inode and block: when none was used since, it is still empty."""
    if not first and [usage(path) for path in spec["tmpfs"]] == spec["fresh"]:
        return
    for path, size_mb in spec["tmpfs"].items():
        if not first:
            check(libc.umount2(path.encode(), MNT_DETACH), f"umount {path}")
        options = f"size={size_mb}m,nr_inodes={INODES},mode=1777".encode()
        check(libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options), path)
    if spec.get("root"):  # /var/tmp is the same directory as /tmp
        if not first:
            check(libc.umount2(b"/var/tmp", MNT_DETACH), "umount /var/tmp")
        bind("/tmp", "/var/tmp", read_only=False)
    work = spec["work"]
    os.makedirs(work, exist_ok=True)
    if spec.get("uid") is not None:
        os.chown(work, spec["uid"], spec["uid"])
    os.chdir(work)
    spec["fresh"] = [usage(path) for path in spec["tmpfs"]]


def usage(path):
    stat = os.statvfs(path)
    return stat.f_bfree, stat.f_ffree


def build_root(root):
    """What bwrap gives, for `unshare`: a read-only tmpfs as /, the system directories bound
    read-only, a few device nodes, mount points for /tmp, /var/tmp and /dev/shm; the host's
    tree gone."""
    new = root["at"]
    check(libc.mount(b"tmpfs", new.encode(), b"tmpfs", MS_NOSUID, b"size=1m,mode=755"), "tmpfs")
    os.umask(0)
    for path in root["binds"]:
        target = new + path
        if os.path.islink(path):
            os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
            os.symlink(os.readlink(path), target)
            continue
        os.makedirs(target, 0o755, exist_ok=True)
        bind(path, target, read_only=True)
    for path in root["hide"]:
        hidden = f"{new}{path}".encode()
        check(libc.mount(b"tmpfs", hidden, b"tmpfs", MS_RDONLY | MS_NOSUID, b"size=4k"), path)
    for name in ("tmp", "var/tmp", "dev/shm"):  # mounted by fresh_directories
        os.makedirs(f"{new}/{name}", 0o755)
    for name in DEVICES:
        os.close(os.open(f"{new}/dev/{name}", os.O_CREAT | os.O_WRONLY, 0o666))
        bind(f"/dev/{name}", f"{new}/dev/{name}", read_only=False)
    os.makedirs(f"{new}/.old", 0o700)
    check(libc.syscall(155, new.encode(), f"{new}/.old".encode()), "pivot_root")  # x86_64
    os.chdir("/")
    check(libc.umount2(b"/.old", MNT_DETACH), "umount old root")
    os.rmdir("/.old")
    check(libc.mount(None, b"/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID, None), "ro /")
    os.umask(0o022)


def bind(source, target, read_only):
    check(libc.mount(source.encode(), target.encode(), None, MS_BIND | MS_REC, None), "bind")
    if read_only:  # keep the flags the kernel locks (nosuid, nodev, ...) of the source mount
        kept = os.statvfs(source).f_flag & (2 | 4 | 8 | 1024 | 2048)
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | kept
        if os.statvfs(source).f_flag & 4096:  # ST_RELATIME
            flags |= 1 << 21
        check(libc.mount(None, target.encode(), None, flags, None), "read-only bind")


def run_case(spec, case, index):
    """Start the case in a new PID namespace, collect what it printed (capped) or returned."""
    stdin = os.memfd_create(f"in{index}")
    os.write(stdin, case.get("input", "").encode())
    os.lseek(stdin, 0, os.SEEK_SET)
    pipes = [os.pipe() for _ in range(4)]  # stdout, result, stderr, how the program ended
    # a bare clone (this process has one thread): the child is pid 1 of a new PID namespace,
    # in an IPC namespace of its own (message queues and semaphores die with the case)
    flags = signal.SIGCHLD | (CLONE_NEWPID | CLONE_NEWIPC if spec["pidns"] else 0)
    pid = libc.syscall(SYS_CLONE, flags, None, None, None, None)
    if pid == 0:
        child(spec, case, stdin, pipes)
    if pid < 0:
        raise OSError(ctypes.get_errno(), "cannot start the case's process")
    for _, w in pipes:
        os.close(w)
    os.close(stdin)
    outcome = collect(pid, [r for r, _ in pipes[:3]], pipes[3][0], spec, "fn_name" in case)
    for r, _ in pipes:
        os.close(r)
    return outcome


def child(spec, case, stdin, pipes):
    """The case's init (pid 1 of its namespace): drops privileges, starts the program, tells
    the harness how it ended; when it exits the kernel kills whatever the program left."""
    code = 1
    try:
        os.setsid()  # a group of its own: kill(0) from the program cannot reach the harness
        wanted = (stdin, pipes[0][1], pipes[2][1], pipes[1][1], pipes[3][1])
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for fd in wanted]
        for target, fd in enumerate(high):  # as fds 0-4
            os.dup2(fd, target)
        os.closerange(5, 1 << 16)
        try:
            limit(spec)
            program = os.fork()
        except Exception as exc:  # the sandbox's fault, not the program's
            os.write(4, f"E{type(exc).__name__}: {exc}".encode())
            raise
        if program == 0:
            os.close(4)
            run_program(spec, case)
        for fd in range(4):
            os.close(fd)
        if spec["no_fork"] and not within_cpu(program, spec["limits"]["case_s"]):
            os.write(4, b"T")  # the harness reports the timeout; exiting kills the program
            code = 0
            return
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == program:
                break
        os.write(4, str(status).encode())
        code = 0
    finally:
        os._exit(code)


def within_cpu(pid, seconds):
    """Wait for the program to end; False once its CPU time (all its threads: it may start
    no process) passes `seconds`. Time other programs take from it does not count."""
    clock = ctypes.c_int()
    if libc.clock_getcpuclockid(pid, ctypes.byref(clock)) != 0:
        raise OSError("no CPU clock for the program")
    done = os.pidfd_open(pid)
    while True:
        left = seconds - time.clock_gettime(clock.value)
        if left <= 0:
            return False
        if select.select([done], [], [], left)[0]:
            return True


def run_program(spec, case):
    """The program's process: never returns."""
    code = 1
    try:
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        dumps = json.dumps  # taken before the program can replace it
        namespace = {"__name__": "__main__" if "fn_name" not in case else "solution"}
        if spec["no_fork"]:
            lib, ctx = spec["no_fork"]
            check(lib.seccomp_load(ctx), "seccomp")
        try:
            exec(compile(spec["code"], "<solution>", "exec"), namespace)
            if "fn_name" in case:
                os.write(3, dumps(call(namespace, case)).encode())
            join_threads()
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


def join_threads():
    """Wait for the program's threads as an interpreter's exit does (the deep-recursion idiom
    does its work in a thread the main thread never joins)."""
    threading = sys.modules.get("threading")
    if threading is not None:
        for thread in threading.enumerate():
            if not thread.daemon and thread is not threading.current_thread():
                thread.join()


def limit(spec):
    """rlimits, then no privilege at all: the sandbox's uid, or no capabilities."""
    limits = spec["limits"]
    cpu = int(limits["case_s"]) + 1
    for name, value in (
        ("RLIMIT_AS", limits["memory_mb"] * 2**20),
        ("RLIMIT_NPROC", spec["nproc"]),
        ("RLIMIT_FSIZE", limits["file_mb"] * 2**20),
        ("RLIMIT_NOFILE", limits["open_files"]),
        ("RLIMIT_CORE", 0),
        ("RLIMIT_CPU", cpu),
    ):
        resource.setrlimit(getattr(resource, name), (value, value))
    uid = spec.get("uid")
    if spec["drop"] == "uid":
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    elif spec["drop"] == "caps":  # root of a user namespace: drop every capability, for good
        check(libc.prctl(PR_SET_SECUREBITS, 0x2F, 0, 0, 0), "securebits")
        for cap in range(64):
            if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                break
        libc.prctl(PR_CAP_AMBIENT, 4, 0, 0, 0)
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)
        check(libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    if spec["filter"] is not None:
        lib, ctx = spec["filter"]
        check(lib.seccomp_load(ctx), "seccomp")


def call(namespace, case):
    """Call the case's function: top level, or a method of LeetCode's `Solution`."""
    name = case["fn_name"]
    target = namespace.get(name)
    if target is None and "Solution" in namespace:
        target = getattr(namespace["Solution"](), name, None)
    if not callable(target):
        raise NameError(f"no function {name!r} defined")
    return target(*case.get("args", []))


def collect(pid, fds, ended, spec, call):
    """Read what the case printed (stdout) or returned (fd 3), capped, and stderr's tail,
    until the case ends or runs out of time; then kill its namespace (killing its pid 1 kills
    everything in it). Only the stream the case is judged on is kept, as bytes."""
    case_s, cap = spec["limits"]["case_s"], spec["limits"]["output_bytes"]
    measured = spec.get("cpu") is not None or spec["no_fork"]  # else its wall clock counts
    wall_s = spec["case_wall_s"] if measured else case_s
    kept = fds[1] if call else fds[0]
    started, used = time.monotonic(), cpu_seconds(spec)
    done = os.pidfd_open(pid)
    data = {fd: b"" for fd in fds}
    sizes = dict.fromkeys(fds, 0)
    status = None
    open_fds = [*fds, done]
    while open_fds:
        left = started + wall_s - time.monotonic()
        if used is not None:  # its CPU time counts (at most one core: it cannot run faster)
            left = min(left, case_s - (cpu_seconds(spec) - used))
        if left <= 0:
            status = "timeout"
            break
        ready, _, _ = select.select(open_fds, [], [], left)
        for fd in ready:
            if fd == done:  # pid 1 ended: the kernel kills the rest; read what is left
                open_fds.remove(fd)
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.remove(fd)
                continue
            sizes[fd] += len(chunk)
            if fd == kept:
                data[fd] += chunk
            elif fd == fds[2]:
                data[fd] = (data[fd] + chunk)[-2000:]
        if sizes[fds[0]] > cap or sizes[fds[1]] > cap:
            status = "output_limit"
            break
    with contextlib.suppress(ProcessLookupError):
        (os.kill if spec["pidns"] else os.killpg)(pid, signal.SIGKILL)
    _, wait_status = os.waitpid(pid, 0)
    os.close(done)
    told = os.read(ended, 300)  # how the program ended, if its init saw it end
    if told.startswith(b"E"):
        raise SandboxFault(f"a test case could not be set up: {told[1:].decode()}")
    if told == b"T":  # its init stopped it at its CPU limit
        status, told = "timeout", str(signal.SIGKILL).encode()
    code = os.waitstatus_to_exitcode(int(told) if told else wait_status)
    out = {"status": status, "exit": code, "s": round(time.monotonic() - started, 3)}
    if status is None:
        out["status"] = "ok" if code == 0 else "error"
        if code != 0:
            out["error"] = describe(code, data[fds[2]])
    return out, data[kept][:cap]


def cpu_seconds(spec):
    """CPU time used by the whole run so far (its cgroup's), None where nothing measures it.
    While a case runs the harness only waits: the increase is the case's own."""
    cpu = spec.get("cpu")
    if cpu is None:
        return None
    text = os.pread(cpu["fd"], 4096, 0).decode()
    if cpu["key"]:
        text = next(line.split()[1] for line in text.splitlines() if line.startswith(cpu["key"]))
    return int(text) * cpu["unit"]


def describe(code, stderr):
    tail = stderr[-600:].decode("utf-8", "replace").strip()
    head = f"exit code {code}"
    if code < 0:
        with contextlib.suppress(ValueError):
            head = f"killed by {signal.Signals(-code).name}"
    return f"{head}: {tail}" if tail else head


def emit(message, output=b""):
    """One JSON line; a case's outcome is followed by its raw output (`"bytes"` long): no
    text encoding inflates what a program printed."""
    if "status" in message:
        message["bytes"] = len(output)
    data = (json.dumps(message) + "\n").encode() + output
    while data:
        data = data[os.write(1, data):]


def main():
    spec = read_frame()
    try:
        prepare(spec)
    except Exception as exc:  # the sandbox itself is broken: the host says `error`
        emit({"fatal": f"{type(exc).__name__}: {exc}"})
        return
    emit({"ready": os.getpid(), "seccomp": spec["filter"] is not None})
    deadline = time.monotonic() + spec["limits"]["time_s"]
    skip = None
    for index in range(spec["cases"]):
        case = read_frame()
        if skip is None and time.monotonic() >= deadline:
            skip = f"not run: the program used up the run's {spec['limits']['time_s']:g} s"
        if skip is not None:
            emit({"status": "skipped", "error": skip})
            continue
        emit({"start": index})
        try:
            if index:
                fresh_directories(spec)
            outcome, output = run_case(spec, case, index)
        except (OSError, SandboxFault) as exc:
            emit({"fatal": str(exc)})
            return
        if outcome["status"] == "timeout":  # it would hang again: skip the remaining cases
            skip = "not run: an earlier case ran over its time limit"
        emit(outcome, output)


if __name__ == "__main__":
    main()
