"""`qrq status --watch` seen as a person sees it: in a real terminal (tmux), read off the screen."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import uuid

import pytest
from support import ROOT, call, judge_backend, wait_for, write_config

import qreward_queue as qrq
from qreward_queue.broker.app import QrqCelery
from qreward_queue.planning.capacity import QueuedSamples

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


def screen(session: str) -> str:
    return tmux("capture-pane", "-p", "-t", session)


def row_of(text: str, backend: str) -> list[str] | None:
    rows = [line.split() for line in text.splitlines() if line.startswith(f"{backend} ")]
    return rows[0] if rows else None


def test_watch_redraws_queue_by_priority_limits_and_eta(tmp_path, redis_url):
    config_path = write_config(
        tmp_path,
        {"ja": judge_backend("http://127.0.0.1:9", rpm=600, max_concurrent=8),
         "jb": judge_backend("http://127.0.0.1:9", rpm=120)},
        redis_url=redis_url, route="ja",
    )
    app = QrqCelery(qrq.load_config(config_path))
    counts = QueuedSamples(app.store)

    def queue(priority: int) -> None:  # a task of 20 samples, counted as a publisher does
        app.send_task("qrq.score_chunk", kwargs={}, queue="qrq.ja", priority=priority)
        counts.add({"qrq.ja": 20})

    for priority in (0, 6, 6, 9):
        queue(priority)
    session = f"qrq-watch-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if k != "QRQ_REDIS_URL"}
    command = (f"cd {shlex.quote(str(ROOT))} && QRQ_CONFIG={shlex.quote(str(config_path))} "
               f"{shlex.quote(sys.executable)} -m qreward_queue.cli status --watch --interval 0.3"
               "; echo watch-exited-$?; sleep 60")
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "150", "-y", "12",
                    command], check=True, env=env)
    try:
        # Given four tasks queued on ja, when the watch view is on screen
        text = wait_for(lambda: row_of(screen(session), "jb") and screen(session), 30,
                        "the status table on the tmux screen")
        assert "qrq status --watch" in text and "Ctrl-C quits" in text
        ja, jb = row_of(text, "ja"), row_of(text, "jb")
        # Then it reads: 80 samples queued, no worker, tasks 1 val / 2 train / 1 bulk, 600 rpm,
        # closed, and an ETA of 80 samples at 10/s
        assert ja[:3] == ["ja", "judge", "80"] and ja[4:7] == ["0", "1/2/1", "600/600"]
        assert ja[-2:] == ["closed", "8.0"]
        assert jb[2:3] + jb[4:7] == ["0", "0", "0/0/0", "120/120"] and jb[-1] == "0.0"
        # When two more validation tasks arrive and a 429 is reported, the screen follows
        queue(0)
        queue(0)
        call(app.flow.limiter("ja"), 429, {"retry-after": "30"})
        text = wait_for(lambda: (r := row_of(screen(session), "ja")) and r[2] == "120" and r,
                        30, "the redrawn row")
        assert text[3] == "0.0"  # samples scored per second since the last redraw
        assert text[5] == "3/2/1"
        assert text[10] == "1"  # 429s in the last minute
        assert float(text[11].rstrip("s")) > 20  # paused for Retry-After
        # And Ctrl-C ends it cleanly
        tmux("send-keys", "-t", session, "C-c")
        text = wait_for(lambda: "watch-exited-" in (t := screen(session)) and t, 15,
                        "the watch to exit")
        assert "watch-exited-0" in text and "Traceback" not in text
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
