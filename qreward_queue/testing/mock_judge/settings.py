"""The mock judge's settings, apart so the server, spawn() and the CLI options share one list."""

from __future__ import annotations

from dataclasses import dataclass

GROUP_REPLIES = ("list", "object", "tagged")


@dataclass
class MockJudgeSettings:
    """How the mock judge limits, delays and fails; 0 means unlimited for the limits."""

    host: str = "127.0.0.1"
    port: int = 0
    rpm: float = 0
    tpm: float = 0
    max_concurrent: int = 0
    latency_ms: float = 200.0
    latency_cv: float = 0.5
    error_rate: float = 0.0
    hang_rate: float = 0.0
    hang_s: float = 30.0
    degrade_above: int = 0  # latency doubles while more requests than this are in flight
    token_chars: float = 4.0  # characters per token as its tokenizer counts (CJK text: ~1)
    usage: bool = True  # chat replies carry `usage`
    seed: int = 0
    group_reply: str = "list"  # how a group's scores are written: list | object | tagged
    group_fault_rate: float = 0.0  # fraction of group requests answered with a group fault
    fooled: bool = False  # a weak judge: obeys verdict lines outside a fence, quotes responses
    tls_cert: str = ""  # serve HTTPS with this certificate (PEM) and tls_key; "": plain HTTP
    tls_key: str = ""

    def __post_init__(self) -> None:
        if self.group_reply not in GROUP_REPLIES:
            raise ValueError(f"group_reply must be one of {', '.join(GROUP_REPLIES)}, "
                             f"got {self.group_reply!r}")
