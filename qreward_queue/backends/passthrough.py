"""A caller's own request, sent to a judge as it came: the gateway's OpenAI front door.

`qrq gateway` puts the body of a `POST /v1/chat/completions` (or of a legacy `POST
/v1/completions`) in the sample's `extra["qrq_request"]`, and which of the two it is in
`extra["qrq_endpoint"]`. A judge sends that body (with its own `model`) to the same endpoint
of its own URL instead of its template, books the call's tokens from its messages (or
prompt) and `max_tokens`, parses no score (0.0), and hands the reply's body back byte for
byte, as the server sent it, in the outcome's `detail`. Everything else (limiter, breaker,
budget, retries, failover) is the judge's as usual.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from .base import Call, usage_split, usage_tokens

if TYPE_CHECKING:
    from .transport import Reply

REQUEST, ENDPOINT = "qrq_request", "qrq_endpoint"
CHAT, COMPLETIONS = "chat", "completions"  # ENDPOINT's values (none: chat)
INPUT = {CHAT: "messages", COMPLETIONS: "prompt"}  # what the model reads, per endpoint


def caller_request(sample: dict) -> dict[str, Any] | None:
    """The caller's request body `sample` carries, None for a sample the judge templates."""
    extra = sample.get("extra")
    body = extra.get(REQUEST) if isinstance(extra, dict) else None
    return body if isinstance(body, dict) else None


def endpoint(sample: dict) -> str:
    """Which endpoint the caller's body of `sample` was sent to: CHAT or COMPLETIONS."""
    return COMPLETIONS if sample["extra"].get(ENDPOINT) == COMPLETIONS else CHAT


def call_request(samples: list[dict]) -> dict[str, Any] | None:
    """The request body of a one-sample call carrying one, else None."""
    return caller_request(samples[0]) if len(samples) == 1 else None


def payload(body: dict[str, Any], model: str | None) -> dict[str, Any]:
    """What goes to the judge: the caller's body, naming the judge's model."""
    return {**body, "model": model}


def input_text(sample: dict) -> str:
    """The JSON of what the model reads in the caller's body: its messages, or its prompt."""
    body = caller_request(sample) or {}
    return json.dumps(body.get(INPUT[endpoint(sample)]), ensure_ascii=False)


def estimate_usage(samples: list[dict], default_max_tokens: int) -> tuple[float, float]:
    """Tokens in (the input's JSON, 4 characters a token) and out (each caller's bound, else
    the judge's `max_tokens`) of a gateway's samples (its batches hold nothing else)."""
    tokens_in = tokens_out = 0.0
    for sample in samples:
        if (body := caller_request(sample)) is None:
            continue
        out = body.get("max_completion_tokens") or body.get("max_tokens")
        if isinstance(out, bool) or not isinstance(out, int) or out < 1:
            out = default_max_tokens
        tokens_in += len(input_text(sample)) / 4
        tokens_out += out
    return tokens_in, tokens_out


def answer(reply: Reply) -> Call:
    """The reply as it came (its usage counted); no score is parsed."""
    return Call([0.0], usage_tokens(reply.body), reply.status_code, reply.headers,
                [reply.raw.decode("utf-8", "replace")], usage_split(reply.body))
