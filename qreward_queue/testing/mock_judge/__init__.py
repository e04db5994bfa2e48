"""The rate-limited, OpenAI-compatible mock LLM judge (see server.py for what it serves)."""

from .server import (
    GROUP_FAULTS,
    MockJudge,
    MockJudgeProcess,
    MockJudgeSettings,
    _Judge,
    fooled_verdict,
    mock_judge_cli,
    rm_verdict,
    spawn,
    split_group,
    verdict,
)

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
