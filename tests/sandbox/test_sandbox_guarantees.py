"""What the code sandbox guarantees, one test per class of attack, under bwrap and unshare.

Programs go through `code_reward` as a worker runs it (the mechanism forced per test). CI runs
this module as root and as a normal user. Each test states the class it checks; the programs
are examples of the class, the assertions are about the class's promise.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from textwrap import dedent

import psutil
import pytest

from qreward_queue.backends import FunctionOptions, make_backend
from qreward_queue.config.model import Backend, Pool
from qreward_queue.rewards import cgroups, sandbox
from qreward_queue.rewards.code import code_reward


@pytest.fixture(params=sandbox.MECHANISMS)
def mechanism(request, monkeypatch):
    why = sandbox.probe(request.param)
    if why is not None:
        pytest.skip(why)
    monkeypatch.setattr(sandbox, "pick_mechanism", lambda unsafe=False: request.param)
    return request.param


def score(program: str, cases: list[dict], **options) -> float:
    return code_reward({"prompt": "", "response": program, "extra": {"tests": cases}}, **options)


def stdin_cases(*pairs: tuple[str, str]) -> list[dict]:
    return [{"input": i, "output": o} for i, o in pairs]


def host_processes_with(marker: str) -> list[psutil.Process]:
    """Processes with `marker` as one of their arguments."""
    return [p for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or ())]


# 1. An infrastructure failure is never a score.
def test_1_every_program_gets_a_working_interpreter_and_a_broken_sandbox_is_an_error(
    mechanism, monkeypatch
):
    # Given a correct program that needs standard modules the harness never loaded
    program = (
        "import heapq, bisect, fractions, decimal, statistics\n"
        "xs = list(map(int, input().split()))\nprint(heapq.nsmallest(2, xs))"
    )
    # Then it passes, wherever the interpreter lives (here: under a root-only home)
    assert score(program, stdin_cases(("5 1 4 2", "[1, 2]"))) == 1.0
    assert sandbox.describe().startswith(f"code sandbox: {mechanism}, ")
    # And when the sandbox itself cannot run, the sample is an error, never a number
    monkeypatch.setattr(sandbox, "HARNESS", "import os; os._exit(3)")
    with pytest.raises(sandbox.SandboxError, match="ended early"):
        score("print(1)", stdin_cases(("", "1")))


def test_1_a_code_pool_refuses_to_start_without_a_working_sandbox(tmp_path, redis_url):
    backend = tmp_path / "code.toml"
    code_reward_path = "qreward_queue.rewards.code:code_reward"
    backend.write_text(f'[backend]\nkind = "function"\nfunction = "{code_reward_path}"\n')
    env = {**os.environ, "PATH": str(tmp_path), "QRQ_REDIS_URL": redis_url}
    done = subprocess.run(
        [sys.executable, "-m", "qreward_queue.cli", "worker", str(backend)],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no sandbox for generated code: bwrap is not installed" in lines[0]


# 2. Comparison cannot be gamed.
def test_2_integers_exactly_floats_within_the_tolerance_and_comparing_never_raises(mechanism):
    near = [("print(1000000000)", "1000000006"), ("print(999999)", "1000000")]
    for program, want in near:
        assert score(program, stdin_cases(("", want))) == 0.0, program
    assert score("print(123456789012345678901234567890)", stdin_cases(("", "0" + "1" * 30))) == 0
    assert score("print('+0012')", stdin_cases(("", "12"))) == 1.0
    assert score("print(0.3333334)", stdin_cases(("", "0.3333333"))) == 1.0
    assert score("print(0.3334)", stdin_cases(("", "0.3333"))) == 0.0
    assert score("print(0.3334)", stdin_cases(("", "0.3333")), float_tol=1e-3) == 1.0
    calls = [{"fn_name": "f", "args": [], "expected": k} for k in (1, 2)]
    assert score("def f():\n    return True", calls[:1]) == 0.0  # a bool is not 1
    hostile = [
        "import json\njson.dumps = lambda *a, **k: 1 / 0\ndef f():\n    return 1",
        "def f():\n    x = []\n    x.append(x)\n    return x",  # circular
        "def f():\n    x = 1\n    for _ in range(100000):\n        x = [x]\n    return x",
        "def f():\n    return eval('[' * 5000 + ']' * 5000)",  # fine to dump, deep to load
        "import json\njson._default_encoder = None\ndef f():\n    return 2",
    ]
    for program in hostile:
        scored = score(program, calls)  # a number, never an exception
        assert 0.0 <= scored <= 0.5 and scored.detail, program


def test_2_hostile_output_is_a_wrong_answer_not_a_hang_nor_an_out_of_memory_helper():
    # Given outputs that made the comparator backtrack and the helper's JSON balloon
    backtrack = score('print("1" * 60000 + "x")', stdin_cases(("", "0.5")))
    assert backtrack == 0.0 and "wrong output" in backtrack.detail
    flood = "import os, sys\nb = b'\\xff' * (1 << 20)\nsys.stdout.buffer.write(b)\n"
    flood += "sys.stdout.flush()\nos.write(3, b)"
    caller = dedent(f"""
        import resource
        from qreward_queue.rewards import sandbox
        from qreward_queue.rewards.code import code_reward
        sandbox.pick_mechanism = lambda unsafe=False: {sandbox.pick_mechanism()!r}
        cap = 768 * 2**20  # far below the 48 x 12.6 MB of JSON escapes this made before
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        tests = [{{"input": "", "output": "1"}}] * 48
        sample = {{"prompt": "", "response": {flood!r}, "extra": {{"tests": tests}}}}
        scored = code_reward(sample, time_s=120)
        print("scored", scored, scored.detail[:60])
    """)
    # Then the sample is scored 0 (each case a wrong answer), in a helper of bounded memory
    done = subprocess.run([sys.executable, "-c", caller], capture_output=True, text=True)
    assert done.returncode == 0 and "scored 0.0 0/48 cases passed" in done.stdout, done


# 3. A failing program cannot make itself unscored.
def test_3_hangs_crashes_and_attacks_on_the_harness_are_failed_cases(mechanism):
    # Given a program that answers even inputs right and attacks the harness on odd ones
    program = dedent("""
        import os, signal, sys
        n = int(input())
        if n % 2 == 0:
            print(n * 2)
            sys.exit(0)
        for path in ("in3", "in5", "stderr", "stdout", "../in3", "/tmp/in3"):
            try:
                os.mkfifo(path)
            except OSError:
                pass
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in {os.getppid(), 1, 2, 3, -1} - {os.getpid()}:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        if n == 7:
            while True:
                pass
        if n == 5:
            os.abort()
        os.kill(0, signal.SIGKILL)
    """)
    cases = stdin_cases(*[(str(n), str(n * 2)) for n in (0, 1, 2, 3, 4, 5, 6)], ("7", "14"))
    started = time.monotonic()
    scored = score(program, cases, case_s=1)
    # Then the sample is scored: every even case passed, the rest failed with a reason
    assert scored == 4 / 8, scored.detail
    for reason in ("case 1: killed by SIGKILL", "case 5: killed by SIGABRT", "case 7: timeout"):
        assert reason in scored.detail
    assert time.monotonic() - started < 8  # deadline promise: 8 cases of case_s=1, SIGSTOP or not


# 4. Limits are per sample, not per process.
def test_4_memory_processes_and_disk_are_bounded_for_the_whole_sample(mechanism):
    forks = dedent("""
        import os, time
        pipes = []
        for _ in range(5):
            r, w = os.pipe()
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                b = bytearray(300 * 2**20)
                b[::4096] = b"x" * len(b[::4096])  # resident, not just reserved
                os.write(w, b"1")
                time.sleep(1)
                os._exit(0)
            pipes.append(r)
        print(sum(len(os.read(r, 1)) for r in pipes))
    """)
    assert score(forks, stdin_cases(("", "5")), case_s=3) == 0.0
    fill = (
        "import os\nn = 0\nfor d in ('/tmp', '/dev/shm', '/var/tmp', '.'):\n"
        "    try:\n        for i in range(20):\n"
        "            with open(f'{d}/f{i}', 'wb') as f:\n"
        "                f.write(b'x' * 15 * 2**20)\n            n += 15\n"
        "    except OSError:\n        pass\nprint('big' if n >= 300 else n)"
    )
    scored = score(fill, stdin_cases(("", "big")), case_s=5)
    assert scored == 0.0, scored.detail
    own_tmpfs = dedent("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        if os.fork() == 0:  # a user and mount namespace of its own, then a tmpfs of its own
            ok = libc.unshare(0x10000000 | 0x20000) == 0 and os.makedirs("m") is None
            ok = ok and libc.mount(b"tmpfs", b"m", b"tmpfs", 0, None) == 0
            os._exit(0 if ok else 1)
        print("mounted" if os.wait()[1] == 0 else "refused")
    """)
    assert score(own_tmpfs, stdin_cases(("", "mounted"))) == 0.0
    # memory spread over many small processes: the out-of-memory killer takes the sandbox's,
    # never the (bigger) process that asked for the run, so the sample is still scored
    caller = dedent(f"""
        from qreward_queue.rewards import sandbox
        from qreward_queue.rewards.code import code_reward
        sandbox.pick_mechanism = lambda unsafe=False: {mechanism!r}
        ballast = bytearray(150 * 2**20)
        ballast[::4096] = b"x" * len(ballast[::4096])
        program = {SPREAD!r}
        tests = [{{"input": "", "output": "x"}}]
        sample = {{"prompt": "", "response": program, "extra": {{"tests": tests}}}}
        print("scored", code_reward(sample, case_s=3))
    """)
    done = subprocess.run([sys.executable, "-c", caller], capture_output=True, text=True)
    assert done.returncode == 0 and "scored 0.0" in done.stdout, done
    layout = cgroups.available()
    if not isinstance(layout, str):  # every run's group is gone once the run is over
        assert not [d for p in layout.parents for d in p.glob(f"qrq-{os.getpid()}-*")]


SPREAD = dedent("""
    import os, time
    for _ in range(30):
        if os.fork() == 0:
            b = bytearray(40 * 2**20)
            b[::4096] = b"x" * len(b[::4096])
            time.sleep(2)
            os._exit(0)
    time.sleep(1.5)
    print("all alive")
""")


class UnixListener:
    def __init__(self, path: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(path)
        self.sock.listen(4)
        os.chmod(path, 0o777)

    def close(self):
        self.sock.close()
        os.unlink(self.path)


# 5. Nothing survives a run or passes between samples.
def test_5_no_leftover_process_file_host_proc_socket_or_data_set(mechanism, tmp_path):
    marker = f"qrq-leftover-{uuid.uuid4().hex[:8]}"
    key = f"sk-canary-{uuid.uuid4().hex[:8]}"
    witness = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", key])
    listeners = [UnixListener(f"/dev/shm/{marker}.sock"), UnixListener(str(tmp_path / "s.sock"))]
    data_set = tmp_path / "answers.json"
    data_set.write_text(json.dumps({"answer": key}))
    data_set.chmod(0o644)
    os.chmod(tmp_path, 0o755)
    try:
        survivors = dedent(f"""
            import os, subprocess, sys
            sleeper = [sys.executable, "-c", "import time; time.sleep(60)", {marker!r}]
            subprocess.Popen(sleeper, start_new_session=True)
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    os.execv(sys.executable, sleeper)
                os._exit(0)
            for d in ("/tmp", "/var/tmp", "/dev/shm", "."):
                try:
                    open(f"{{d}}/{marker}", "w").write("{key}")
                except OSError:
                    pass
            print("planted")
        """)
        assert score(survivors, stdin_cases(("", "nothing"))) == 0.0
        time.sleep(0.3)
        assert not host_processes_with(marker)
        snoop = (
            "import glob, os, socket\nfound = []\n"
            "for pattern in ('/proc/*/cmdline', '/proc/*/environ', "
            f"'/tmp/{marker}', '/var/tmp/{marker}', '/dev/shm/{marker}', '{marker}', "
            f"{str(data_set)!r}):\n"
            "    for path in glob.glob(pattern):\n        try:\n"
            f"            if {key!r} in open(path, errors='replace').read():\n"
            "                found.append(path)\n        except OSError:\n            pass\n"
            f"for path in ({listeners[0].path!r}, {listeners[1].path!r}):\n"
            "    try:\n        s = socket.socket(socket.AF_UNIX)\n        s.connect(path)\n"
            "        found.append(path)\n    except OSError:\n        pass\n"
            "print('found' if found else 'clean', found)"
        )
        scored = score(snoop, stdin_cases(("", "found")))
        assert scored == 0.0, scored.detail
        # a later case cannot read an earlier or later case's input from the harness's memory
        peek = dedent("""
            import gc, sys
            def has(o):
                try:
                    return "".join(["SECRET", "-CASE-1"]) in repr(o)[:100000]
                except Exception:
                    return False
            seen = any(has(o) for o in gc.get_objects())
            frame = sys._getframe().f_back
            while frame is not None and not seen:
                seen = any(has(v) for v in frame.f_locals.values())
                frame = frame.f_back
            print("found" if seen else "none")
        """)
        cases = [{"input": "x", "output": "found"}, {"input": "SECRET-CASE-1", "output": "x"}]
        assert score(peek, cases) == 0.0
        assert not (tmp_path / marker).exists()
        assert not os.path.exists(f"/dev/shm/{marker}") and not os.path.exists(f"/var/tmp/{marker}")
    finally:
        witness.kill()
        for listener in listeners:
            listener.close()


def test_5_a_function_backends_child_in_a_new_session_does_not_outlive_its_sample():
    marker = f"qrq-fn-leftover-{uuid.uuid4().hex[:8]}"
    client = make_backend(
        Backend(name="spawner", kind="function", chunk_size=2, timeout_s=2,
                pool=Pool(type="prefork"),
                options=FunctionOptions(function="tests.rewards_for_tests:spawn_and_return",
                options={"marker": marker}))
    )
    scores = client.call([{"prompt": "", "response": "ok"}, {"prompt": "", "response": "hang"}])
    assert scores.scores[0] == 1.0 and scores.scores[1].status == "timeout"
    time.sleep(0.3)
    assert not host_processes_with(marker)


# 6. The unshare fallback keeps the same promises.
def test_6_the_sandbox_sees_only_system_directories_read_only_and_reaches_nothing(mechanism):
    view = (
        "import os\nprint(sorted(os.listdir('/')))\n"
        "print(os.path.exists('/proc/1'), os.path.exists('/run'), os.path.exists('/work'))\n"
        "wrote = []\nfor path in ('/usr/qrq-x', '/bin/qrq-x', '/qrq-x', '/etc/qrq-x'):\n"
        "    try:\n        open(path, 'w')\n        wrote.append(path)\n"
        "    except OSError:\n        pass\n"
        "import ctypes\nlibc = ctypes.CDLL(None)\n"
        "print(wrote, [p for p in range(1, 400) if libc.ptrace(16, p, 0, 0) == 0])"  # ATTACH
    )
    cases = stdin_cases(("", "x"))
    scored = score(view, cases)
    assert scored == 0.0
    run = sandbox.run_cases(view, [{"input": ""}])
    lines = run.cases[0]["stdout"].splitlines()
    top = set(json.loads(lines[0].replace("'", '"')))
    system = {path.split("/")[1] for path in sandbox._system_paths()}
    assert top <= system | {"tmp", "dev", "var"}, top
    assert lines[1] == "False False False"
    assert lines[2] == "[] []"  # nothing it could write outside /tmp, nothing it could ptrace
    hidden = sandbox._hidden_paths()  # installed packages: a data set may ship in one
    listing = f"import os\nprint([os.listdir(p) for p in {hidden!r}])"
    run = sandbox.run_cases(listing, [{"input": ""}])
    assert run.cases[0]["stdout"].strip() == str([[] for _ in hidden])
    # whatever site or dist directory the interpreter has (Debian's dist-packages included)
    roots = [sys.base_prefix, "/usr", "/usr/local"]
    shown = (
        "import glob, os\n"
        f"paths = [p for r in {roots!r} for p in glob.glob(r + '/lib*/python*/*-packages')]\n"
        "print(len(paths), [p for p in paths if os.listdir(p)])"
    )
    out = sandbox.run_cases(shown, [{"input": ""}]).cases[0]["stdout"].split(" ", 1)
    assert int(out[0]) >= 1 and out[1].strip() == "[]", out


# 7. No socket, memory or session outside what the run is bounded by.
REACH = dedent("""
    import ctypes, os, socket
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    got = []
    for name, family in (("vsock", 40), ("inet", 2), ("inet6", 10), ("netlink", 16),
                         ("packet", 17), ("alg", 38), ("bluetooth", 31)):
        try:
            socket.socket(family, socket.SOCK_STREAM if family != 16 else socket.SOCK_RAW).close()
            got.append(name)
        except OSError:
            pass
    if libc.syscall(41, (1 << 32) | 40, 1, 0) >= 0:  # vsock with the upper bits set
        got.append("vsock-high-bits")
    if libc.syscall(29, 0, 1 << 20, 0o1600) >= 0:  # shmget(IPC_PRIVATE, 1 MB)
        got.append("sysv-shm")
    if libc.syscall(319, b"x", 0) >= 0:  # memfd_create
        got.append("memfd")
    for call in (os.setsid, lambda: os.setpgid(0, 0)):
        try:
            call()
            got.append(call.__name__)
        except OSError:
            pass
    a, b = socket.socketpair()
    print(got, "unix-ok" if a.send(b"x") == 1 and b.recv(1) == b"x" else "unix-broken")
""")


def test_7_only_unix_sockets_no_sysv_or_memfd_memory_no_new_session(mechanism):
    # Given a program reaching for every socket family, memory outside its address space
    # and a session of its own (one more CPU share under the kernel's autogroup)
    run = sandbox.run_cases(REACH, [{"input": ""}])
    # Then only AF_UNIX sockets work; the rest is refused
    assert run.cases[0]["stdout"].strip() == "[] unix-ok", run.cases[0]
    # And a backend that asks for loopback networking gets TCP on the run's own 127.0.0.1
    tcp = "import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\nprint('bound')"
    assert score(tcp, stdin_cases(("", "bound"))) == 0.0
    assert score(tcp, stdin_cases(("", "bound")), loopback=True) == 1.0


# 8. A sample's CPU use cannot cost a neighbour its score.
def test_8_innocent_samples_keep_their_scores_beside_a_neighbour_spinning_in_new_sessions(
    mechanism, monkeypatch
):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import sandbox_neighbours

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(sys.path))  # the neighbour's mechanism:
    monkeypatch.setattr(sandbox_neighbours, "HOSTILE", sandbox_neighbours.HOSTILE.replace(
        "import sys\n", f"import sys\nfrom qreward_queue.rewards import sandbox\n"
        f"sandbox.pick_mechanism = lambda unsafe=False: {mechanism!r}\n", 1))
    # Given another process scoring a correct program whose 40 children each try setsid()
    # and spin in every case, when 8 innocent samples (case_s=1) are scored beside it
    run = sandbox_neighbours.with_neighbour("setsid_spinners")
    # Then every innocent sample passes all its cases
    assert run["innocent_passed"] == "8/8", run


def test_7_page_cache_a_caller_holds_does_not_raise_the_next_runs_memory_bound(tmp_path):
    layout = cgroups.available()
    if isinstance(layout, str):
        pytest.skip(layout)
    # Given a single-threaded caller (a helper) whose group was charged 200 MB of page cache
    caller = dedent(f"""
        import os
        from qreward_queue.rewards import cgroups
        layout = cgroups.available()
        group, entered = cgroups.for_run(layout, 64 << 20, 8)
        cgroups.release(group, entered)
        with open({str(tmp_path / "cache")!r}, "wb") as f:
            for _ in range(200):
                f.write(os.urandom(1 << 20))
        cached, _ = group.usage()
        group, entered = cgroups.for_run(layout, 64 << 20, 8)
        name = "memory.max" if layout.version == 2 else "memory.limit_in_bytes"
        print(cached, group.anonymous(), int(group._path(name).read_text()))
        cgroups.release(group, entered)
    """)
    done = subprocess.run([sys.executable, "-c", caller], capture_output=True, text=True)
    cached, anonymous, bound = map(int, done.stdout.split())
    # Then the next run's bound is its budget above the caller's own memory, not the cache
    assert bound == anonymous + (64 << 20) and cached > bound, (cached, anonymous, bound)
