"""Reward functions that misbehave on purpose, imported by path by test workers."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def misbehave(sample: dict, bonus: float = 0.0) -> float:
    """Scores len(response) + bonus, unless the response asks for trouble."""
    extra = sample.get("extra") or {}
    if extra.get("pid_file"):
        Path(extra["pid_file"]).write_text(str(os.getpid()))
    what = sample["response"]
    if what == "loop":
        while True:
            pass
    if what == "swallow":  # a function that catches everything cannot outlive its limit either
        while True:
            try:
                time.sleep(0.01)
            except BaseException:
                continue
    if what == "c_loop":  # a loop inside C never looks at signals: only a kill stops it
        return float(sum(range(10**15)))
    if what == "alloc":
        return float(len(bytearray(10 * 2**30)))
    if what == "die":
        os._exit(3)
    if what == "alarm":  # math-verify's timeouts: signal.alarm works only in a main thread
        signal.signal(signal.SIGALRM, lambda *_: None)
        signal.alarm(5)
        signal.alarm(0)
        return 7.0
    return len(what) + bonus


def pid_score(sample: dict) -> float:
    """The helper's pid, and optionally keep some memory alive in it."""
    keep = (sample.get("extra") or {}).get("keep_mb", 0)
    if keep:
        block = bytearray(keep * 2**20)
        block[::4096] = b"x" * len(block[::4096])  # touch every page so it counts as resident
        pid_score.held = [*getattr(pid_score, "held", []), block]
    return float(os.getpid())


def spawn_and_return(sample: dict, marker: str) -> float:
    """Start a process in a new session (it would run for a minute), then return or hang."""
    import subprocess
    import sys

    code = "import time; time.sleep(60)"
    subprocess.Popen([sys.executable, "-c", code, marker], start_new_session=True)
    if sample["response"] == "hang":
        time.sleep(60)
    return 1.0
