"""The function backend's helper processes: where a reward function runs, under its limits.

Only a call loads this module (`function.FunctionBackend.call`): a trainer reads the kind's
facts without the process machinery.

The function never runs in the worker's own process: each pool process (a prefork child, or a
thread of a `threads` pool or of embedded mode) hands its chunk to one helper process of its
own. That gives per-sample limits that hold whatever the function does:
- a sample running longer than `timeout_s` is `timeout`: its helper (and anything it started)
  is SIGKILLed, so it stops burning CPU, and the rest of the chunk runs in a fresh helper;
- the helper's address space is capped (`[pool] memory_limit_mb`, RLIMIT_AS), so a 10 GB
  allocation is a MemoryError for that sample, not an out-of-memory kill of the worker;
- helpers are recycled after `max_tasks_per_child` chunks or above `max_memory_per_child_mb`;
- the function runs in the main thread of a process, so signal-based libraries (math-verify's
  timeouts use SIGALRM) work in embedded mode too.
One failing sample becomes its own `error` outcome; the rest of the chunk is still scored.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import math
import mmap
import multiprocessing
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable
from functools import cache
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, cast

from ..config.model import Backend
from ..errors import PermanentError, SampleTimeout, ScoringError

if TYPE_CHECKING:
    from .function import FunctionOptions

FLUSH_S = 0.02  # a helper sends its results at least this often, so a kill loses little work
STARTUP_GRACE_S = 30.0  # a new helper's imports before sample 0 are not that sample's time
POLL_S = 0.25  # the parent looks at the slot at least this often (a new helper's first stamp)
FRAME_ROOM = 128 * 1024  # bytes of frame stack the helper loop reserves (see _with_frame_room)
_PAGE = os.sysconf("SC_PAGE_SIZE")
PR_SET_CHILD_SUBREAPER = 36
_local = threading.local()


@cache
def load_function(path: str) -> Callable[..., Any]:
    """Import 'package.module:callable' once per process."""
    module_name, _, attr = path.partition(":")
    try:
        target = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise PermanentError(f"cannot import reward function {path!r}: {exc}") from None
    if not callable(target):
        raise PermanentError(f"reward function {path!r} is not callable")
    return target


def runner(config: Backend) -> HelperRunner:
    """The helper of this thread (and process) for `config`'s backend."""
    runners = _local.__dict__.setdefault("runners", {})
    found = runners.get(config.name)
    if found is None or found.config != config or found.owner != os.getpid():
        found = runners[config.name] = HelperRunner(config)
    return found


class HelperRunner:
    """One helper process running a backend's function; replaced when a sample overruns.

    The helper writes the index of the sample it runs and that sample's start time into
    `slot` (shared memory, no system call), so the parent can tell which sample overran
    without a message per sample.
    """

    def __init__(self, config: Backend):
        self.config, self.owner = config, os.getpid()
        self._slot_fd = os.memfd_create("qrq-helper-slot")
        os.ftruncate(self._slot_fd, 16)
        self.slot = (ctypes.c_double * 2).from_buffer(mmap.mmap(self._slot_fd, 16))
        self.proc: _Forked | _Spawned | None = None
        self.conn: Connection | None = None
        self.chunks = 0

    def score(self, samples: list[dict]) -> list[float | tuple[float, str] | ScoringError]:
        results: list[float | ScoringError | None] = [None] * len(samples)
        pending = list(range(len(samples)))
        while pending:
            pending = self._run(samples, pending, results)
        self.chunks += 1
        self._recycle_if_due()
        return results  # type: ignore[return-value]

    def _run(self, samples: list[dict], pending: list[int], results: list) -> list[int]:
        """Score `pending` in the helper; return what is left after a timeout or a crash."""
        message = json.dumps([samples[p] for p in pending]).encode()
        conn = self._start()
        try:
            self._stamp()
            conn.send_bytes(message)
        except OSError:  # the helper died since the last chunk: start a fresh one
            self.stop()
            conn = self._start()
            self._stamp()
            conn.send_bytes(message)
        limit, got = self.config.timeout_s, 0
        while got < len(pending):
            k = int(self.slot[0])
            wait = self.slot[1] + limit - time.monotonic()
            if wait <= 0 and int(self.slot[0]) == k:
                self.stop()
                got = _drain(conn, pending, results, got)
                if int(self.slot[0]) != k or k < got:  # it finished right at the limit: go on
                    return pending[got:]
                results[pending[k]] = SampleTimeout(
                    f"reward function ran over the {limit:g} s limit per sample "
                    f"(backend {self.config.name!r}); its process was killed"
                )
                return pending[got:k] + pending[k + 1 :]
            try:
                if conn.poll(min(max(wait, 0.001), POLL_S)):
                    got = _receive(conn.recv_bytes(), pending, results)
            except (EOFError, OSError):
                how = self._exit_reason()
                got = _drain(conn, pending, results, got)
                k = max(int(self.slot[0]), got)
                results[pending[k]] = PermanentError(
                    f"reward process died ({how}) while scoring this sample"
                )
                return pending[got:k] + pending[k + 1 :]
        return []

    def _stamp(self) -> None:
        """Start the clock of sample 0; a new helper (no chunk done yet) gets time to start
        up first, so its imports are not blamed on a sample (the helper stamps each sample
        itself as it begins)."""
        grace = STARTUP_GRACE_S if self.chunks == 0 else 0.0
        self.slot[1], self.slot[0] = time.monotonic() + grace, 0

    def _start(self) -> Connection:
        if self.proc is not None and self.proc.is_alive() and self.conn is not None:
            return self.conn
        self.stop()
        parent, child = multiprocessing.Pipe()
        # the function backend's client, which checked its options, made this runner
        fn, memory = cast("FunctionOptions", self.config.options), self.config.pool.memory_limit_mb
        if threading.active_count() == 1:  # fork is fast and inherits the imported function
            args = (child, self.slot, fn.function, fn.options, memory)
            self.proc = _Forked(_helper_main, args)
        else:
            setup = {"conn_fd": child.fileno(), "slot_fd": self._slot_fd, "path": sys.path}
            setup |= {"function": fn.function, "options": fn.options, "memory": memory}
            self.proc = _Spawned(setup)
        child.close()
        self.conn, self.chunks = parent, 0
        return parent

    def _exit_reason(self) -> str:
        if self.proc is None:
            return "not started"
        self.proc.join(5)
        code = self.proc.exitcode
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    def _recycle_if_due(self) -> None:
        pool = self.config.pool
        over_tasks = pool.max_tasks_per_child and self.chunks >= pool.max_tasks_per_child
        rss_mb = _rss_mb(self.proc.pid) if self.proc is not None else 0.0
        over_memory = pool.max_memory_per_child_mb and rss_mb > pool.max_memory_per_child_mb
        if over_tasks or over_memory:
            self.stop()

    def __del__(self) -> None:  # a thread that ends takes its helper along
        if self.owner == os.getpid():
            with contextlib.suppress(Exception):
                self.stop()

    def stop(self) -> None:
        """Kill the helper and everything it started (in its process group or not)."""
        if self.proc is not None and self.proc.pid is not None:
            kill_tree(self.proc.pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.join(5)
        if self.conn is not None:
            self.conn.close()
        self.proc = self.conn = None


class _Forked:
    """A helper made with a bare os.fork: prefork pool children count as daemonic processes,
    which multiprocessing forbids to have children of their own."""

    def __init__(self, target: Callable[..., None], args: tuple):
        self.exitcode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:  # the helper: never return into the caller's code
            code = 1
            try:
                target(*args)
                code = 0
            finally:
                os._exit(code)

    def is_alive(self) -> bool:
        return self.join(0) is None

    def join(self, timeout: float = 0.0) -> int | None:
        deadline = time.monotonic() + timeout
        while self.exitcode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.exitcode = -1
                break
            if pid:
                self.exitcode = os.waitstatus_to_exitcode(status)
            elif time.monotonic() >= deadline:
                break
            else:
                time.sleep(0.01)
        return self.exitcode


class _Spawned:
    """A helper in a fresh interpreter. With other threads alive a fork could inherit a lock
    held mid-operation; multiprocessing's spawn and forkserver would re-run the caller's
    script (a trainer script without a `__main__` guard would start again)."""

    def __init__(self, setup: dict):
        code = "from qreward_queue.backends.function_runner import _spawned_main; _spawned_main()"
        self.popen = subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(setup)],
            pass_fds=(setup["conn_fd"], setup["slot_fd"]),
        )
        self.pid = self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.returncode

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float = 0.0) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)
        return self.popen.returncode


def _spawned_main() -> None:
    """Entry point of a `_Spawned` helper: the setup is argv[1] (JSON)."""
    setup = json.loads(sys.argv[1])
    sys.path[:] = setup["path"]
    slot = (ctypes.c_double * 2).from_buffer(mmap.mmap(setup["slot_fd"], 16))
    conn = Connection(setup["conn_fd"])
    _helper_main(conn, slot, setup["function"], setup["options"], setup["memory"])


_ERRORS = {"timeout": SampleTimeout, "error": PermanentError}


def _receive(message: bytes, pending: list[int], results: list) -> int:
    """Store one helper message (`[first index, [score, [score, detail] or
    [status, reason], ...]]`)."""
    start, values = json.loads(message)
    for j, value in enumerate(values):
        if not isinstance(value, list):
            results[pending[start + j]] = float(value)
        elif isinstance(value[0], str):
            results[pending[start + j]] = _ERRORS[value[0]](value[1])
        else:
            results[pending[start + j]] = (float(value[0]), value[1])
    return start + len(values)


def _children(pid: int) -> list[int]:
    found = []
    with contextlib.suppress(OSError, ValueError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                found += [int(x) for x in fh.read().split()]
    return found


def kill_tree(pid: int, keep_root: bool = False) -> None:
    """SIGKILL `pid` and all its descendants, whatever session or group they moved to: each
    is stopped first (so it cannot fork away), then all are killed. The helper is a child
    subreaper, so a descendant whose parent died is still found under it."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        if current != pid or not keep_root:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(current, signal.SIGSTOP)
        found.append(current)
        todo += [c for c in _children(current) if c not in found]
    for current in found:
        if current != pid or not keep_root:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(current, signal.SIGKILL)


def _drain(conn: Connection, pending: list[int], results: list, got: int) -> int:
    """Read the results a dead helper sent before it died."""
    with contextlib.suppress(EOFError, OSError):
        while conn.poll(0):
            got = _receive(conn.recv_bytes(), pending, results)
    return got


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as fh:
            return int(fh.read().split()[1]) * _PAGE / 2**20
    except (OSError, IndexError, ValueError):
        return 0.0


def _helper_main(
    conn: Connection, slot, path: str, options: dict, memory_limit_mb: int | None
) -> None:
    """The helper's set-up: its own process group, dies with its parent, capped memory."""
    os.setpgrp()  # the parent kills this group: the helper and whatever the function started
    _die_with_parent()
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans stay in our tree
    if memory_limit_mb:
        cap = memory_limit_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    _serve(conn, slot, load_function(path), options)


def _with_frame_room(func: Callable[..., Any]) -> Callable[..., Any]:
    """`func` in a frame that keeps ~128 KB of CPython's frame stack to itself.

    CPython 3.11+ stores frames in 16 KB chunks and frees a chunk as soon as its last frame
    returns, so a reward function that recurses back and forth across a chunk boundary
    (math-verify's LaTeX parser does) pays an mmap, an munmap and page faults each time:
    measured 8,000 pairs a second, about 2 ms of system time per math-verify sample. A frame
    larger than a chunk gets a chunk of its own of twice its size, kept while it runs: the
    reward function's frames fit in the other half.
    """
    code = func.__code__.replace(co_stacksize=func.__code__.co_stacksize + FRAME_ROOM // 8)
    return types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__)


def _serve_loop(conn: Connection, slot, fn: Callable[..., Any], options: dict) -> None:
    """Receive a list of samples, score them in order, send results; until the pipe closes."""
    while True:
        try:
            samples = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        out: list[float | list[float | str]] = []
        first, flushed = 0, time.monotonic()
        for k, sample in enumerate(samples):
            slot[1] = time.monotonic()
            slot[0] = k
            value = _score_one(fn, sample, options)
            _end_leftovers()
            detail = getattr(value, "detail", None)
            if isinstance(value, float):
                out.append([float(value), detail] if isinstance(detail, str) else float(value))
            else:
                out.append([value.status, str(value)])
            now = time.monotonic()
            if now - flushed >= FLUSH_S or k == len(samples) - 1:
                conn.send_bytes(json.dumps([first, out]).encode())
                first, out, flushed = k + 1, [], now


_serve = _with_frame_room(_serve_loop)


def _end_leftovers() -> None:
    """Nothing a sample started outlives it: kill the helper's descendants, reap them."""
    if not _children(os.getpid()):
        return
    kill_tree(os.getpid(), keep_root=True)
    with contextlib.suppress(ChildProcessError):
        while True:
            os.waitpid(-1, 0)


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: a killed pool child takes its helper with it (Linux only)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def _score_one(fn: Callable[..., Any], sample: dict, options: dict) -> float | ScoringError:
    try:
        value = fn(sample, **options)
    except SampleTimeout as exc:  # the function knows it ran out of time (e.g. code_reward)
        return exc
    except Exception as exc:  # a user function may raise anything; it must not sink the chunk
        return PermanentError(f"reward function raised {type(exc).__name__}: {exc}"[:500])
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        return PermanentError(f"reward function returned {value!r}"[:200] + ", not a finite number")
    return value if isinstance(getattr(value, "detail", None), str) else float(value)


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False
