"""Unit tests of qreward_queue/background.py: a daemon starts once per process, and a forked
child (a prefork worker's) gets fresh per-process state and threads of its own."""

from __future__ import annotations

import json
import os
import select
import signal
import threading
import time
from collections.abc import Callable

import fakeredis

from qreward_queue import background, flushing
from qreward_queue.background import Daemon, PerProcess

ANSWER_S = 10.0  # a child answers at once; one that does not is stuck


class Made:
    """A per-process value that remembers which process made it."""

    def __init__(self) -> None:
        self.pid = os.getpid()


def in_child(check: Callable[[], dict]) -> dict:
    """`check()` run in a child forked now, its answer sent back as JSON (or its error)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer, then leave without running the parent's cleanup
        try:
            answer = json.dumps(check())
        except BaseException as exc:
            answer = json.dumps({"error": repr(exc)})
        finally:
            os.write(write, answer.encode())
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        answered = select.select([pipe], [], [], ANSWER_S)[0]
        if not answered:  # stuck (on a lock its parent held at the fork): stop it
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        assert answered, f"the forked child did not answer within {ANSWER_S} s"
        return json.loads(pipe.read())


def threads_named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name and t.is_alive()]


def test_a_daemon_starts_once_however_many_threads_ask():
    runs, stop = [], threading.Event()
    daemon = Daemon("qrq-unit-once", lambda: (runs.append(1), stop.wait(10)))
    askers = [threading.Thread(target=daemon.ensure) for _ in range(16)]
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join()
    daemon.ensure()
    time.sleep(0.05)
    try:
        assert runs == [1]
        [started] = threads_named("qrq-unit-once")
        assert started.daemon
    finally:
        stop.set()


def test_a_daemon_that_ended_is_started_again_by_the_next_use():
    runs: list[int] = []
    daemon = Daemon("qrq-unit-again", lambda: runs.append(1))
    daemon.ensure()
    deadline = time.monotonic() + 5
    while threads_named("qrq-unit-again") or not runs:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    daemon.ensure()
    deadline = time.monotonic() + 5
    while len(runs) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_per_process_value_is_made_once_in_a_process():
    made = PerProcess(Made)
    values = []
    askers = [threading.Thread(target=lambda: values.append(made.get())) for _ in range(16)]
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join()
    assert made.peek() is values[0] and all(v is values[0] for v in values)
    made.forget()
    assert made.peek() is None and made.get() is not values[0]


def test_a_forked_child_makes_its_own_value_and_thread_even_with_a_lock_held_at_the_fork():
    made = PerProcess(Made)
    parent = made.get()
    stop = threading.Event()
    daemon = Daemon("qrq-unit-fork", lambda: stop.wait(30))
    daemon.ensure()
    holding, release = threading.Event(), threading.Event()

    def hold_the_lock() -> None:  # a parent thread in the middle of a use as the fork happens
        with made.locked():
            holding.set()
            release.wait(10)

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    holding.wait(5)

    def check() -> dict:
        before = made.peek()
        value = made.get()  # would wait forever on the parent's held lock
        daemon.ensure()
        return {"forgotten": before is None, "pid": value.pid,
                "threads": len(threads_named("qrq-unit-fork"))}

    try:
        answer = in_child(check)
    finally:
        release.set()
        stop.set()
        holder.join()
    assert answer.get("forgotten") and answer.get("threads") == 1, answer
    assert answer["pid"] != os.getpid()
    assert made.get() is parent  # the parent keeps its own


def test_a_forked_child_flushes_on_a_flusher_thread_of_its_own():
    flushed = threading.Event()

    class Target:
        store = fakeredis.FakeRedis()

        def stage(self, pipe: object) -> flushing.Written:
            return lambda written: flushed.set()

    flushing.flush_at(Target(), time.monotonic())  # the parent's flusher thread runs
    assert flushed.wait(5)

    def check() -> dict:
        flushed.clear()
        flushing.flush_at(Target(), time.monotonic())
        return {"flushed": flushed.wait(5), "threads": len(threads_named("qrq-flusher"))}

    assert in_child(check) == {"flushed": True, "threads": 1}


def test_the_package_has_one_fork_hook_and_one_maker_of_threads():
    package = os.path.dirname(background.__file__)
    found = {"os.register_at_fork(": [], "threading.Thread(": []}
    for root, _, files in os.walk(package):
        if os.path.relpath(root, package).split(os.sep)[0] == "testing":  # test servers' own
            continue
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as source:
                    text = source.read()
                for call, where in found.items():
                    where.extend([os.path.relpath(path, package)] * text.count(call))
    assert found == {"os.register_at_fork(": ["background.py"],
                     "threading.Thread(": ["background.py"]}
