"""A rate-limited, OpenAI-compatible mock LLM judge for the demo, the tests and the benchmarks.

It is a stdlib HTTP server (plus a click entry point), so it runs anywhere the package does.
Its parts, one job each:
    settings.py   MockJudgeSettings: how it limits, delays and fails
    verdicts.py   what it answers: the verdict rule, group prompts, the weak (`fooled`) judge
    wire.py       the OpenAI requests it reads and the replies it writes (chat, completions,
                  rewards)
    anthropic.py  Anthropic's Messages API, judged as the chat call it is
    limits.py     admission: rate-limit buckets, concurrency, latency and fault draws, counters
    server.py     the HTTP server, its endpoints and faults, MockJudge (in this process)
    process.py    spawn() (in a subprocess) and the `qrq mock-judge` command
This module re-exports what the demo, the examples, the tests and the benchmarks import.
"""

from .limits import _Judge
from .process import MockJudgeProcess, mock_judge_cli, spawn
from .server import MockJudge
from .settings import MockJudgeSettings
from .verdicts import GROUP_FAULTS, fooled_verdict, rm_verdict, split_group, verdict

__all__ = [
    "GROUP_FAULTS",
    "MockJudge",
    "MockJudgeProcess",
    "MockJudgeSettings",
    "_Judge",
    "fooled_verdict",
    "mock_judge_cli",
    "rm_verdict",
    "spawn",
    "split_group",
    "verdict",
]
