"""Anthropic's Messages API (`/v1/messages`), translated to the chat call it is judged and
limited as, and its replies back into Anthropic's shapes.

The request needs `x-api-key` (else 401) and `anthropic-version` (else 400), `model`,
`max_tokens` and `messages` (text or text blocks), `system` apart; it is answered in Anthropic's
shapes: the reply's text in `content[0].text`, usage as `input_tokens`/`output_tokens`, errors
as `{"type": "error", "error": {"type", "message"}}`, the limits as
`anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}` (the reset an RFC 3339 time), a
429 with `retry-after` in whole seconds, and `[[mock:529]]` in the judged text answered 529
overloaded_error (costing nothing).
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone

from ...flow.ratelimit_headers import parse_duration
from .settings import MockJudgeSettings
from .wire import Json, _BadRequest, _Call, _load_object, _parse_chat


def _anthropic_call(body: bytes, settings: MockJudgeSettings) -> _Call:
    """A Messages request, judged as the chat call it is, its reply an Anthropic message."""
    call = _parse_chat(_messages_as_chat(body), settings)
    chat_reply = call.reply
    call.reply = lambda: _as_message(chat_reply())
    return call


_ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error",
                     404: "not_found_error", 429: "rate_limit_error", 529: "overloaded_error"}


def _messages_as_chat(body: bytes) -> bytes:
    """An Anthropic Messages request as the chat request it is judged as (400s name the
    Anthropic field)."""
    payload = _load_object(body)
    if type(payload.get("max_tokens")) is not int:
        raise _BadRequest("max_tokens: Field required (a positive integer)")
    messages = payload.get("messages")
    if not isinstance(messages, list):
        raise _BadRequest("messages: Field required (a list)")
    chat = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):  # text blocks
            if not all(isinstance(b, dict) and isinstance(b.get("text"), str) for b in content):
                raise _BadRequest(f"messages.{i}.content: text blocks only")
            content = "".join(b["text"] for b in content)
        if not isinstance(content, str) or message.get("role") not in ("user", "assistant"):
            raise _BadRequest(f"messages.{i}: role user or assistant, and content")
        chat.append({"role": message["role"], "content": content})
    if "system" in payload:
        if not isinstance(payload["system"], str):
            raise _BadRequest("system: a string")
        chat.insert(0, {"role": "system", "content": payload["system"]})
    return json.dumps({**payload, "messages": chat}).encode()


def _as_message(chat_reply: Json) -> Json:
    """A chat.completion reply as an Anthropic message."""
    usage = chat_reply["usage"]
    return {
        "id": f"msg_{chat_reply['id'].removeprefix('chatcmpl-')}",
        "type": "message",
        "role": "assistant",
        "model": chat_reply["model"],
        "content": [{"type": "text", "text": chat_reply["choices"][0]["message"]["content"]}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": usage["prompt_tokens"],
                  "output_tokens": usage["completion_tokens"]},
    }


def _anthropic_reply(status: int, body: bytes, headers: dict[str, str]
                     ) -> tuple[bytes, dict[str, str]]:
    """A reply of the chat route in Anthropic's shapes: its error body and its headers."""
    if status != 200:
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = body.decode("utf-8", "replace")
        kind = _ANTHROPIC_ERRORS.get(status, "api_error")
        body = json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()
    now = time.time()
    out: dict[str, str] = {}
    for name, value in headers.items():
        parts = name.lower().split("-")
        if parts[:2] == ["x", "ratelimit"]:  # x-ratelimit-{part}-{kind}
            part, kind = parts[2], parts[3]
            if part == "reset":
                at = datetime.fromtimestamp(now + parse_duration(value), timezone.utc)
                value = at.isoformat(timespec="milliseconds").replace("+00:00", "Z")
            out[f"anthropic-ratelimit-{kind}-{part}"] = value
        elif name.lower() == "retry-after":
            out["retry-after"] = value
    return body, out
