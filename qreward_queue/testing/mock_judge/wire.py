"""The OpenAI-compatible wire formats: each scoring request read into a validated call (its
cost, its fault triggers, its reply) and the reply and error bodies, apart from how the judge
decides and how the server admits.

Tokens are ceil(characters / 4). A chat call costs prompt_tokens plus max_tokens when given (as
OpenAI reserves it), else plus completion_tokens; a rewards call costs the sum over its items of
ceil((len(prompt) + len(response)) / 4) and counts as one request.

Triggers in the judged text (chat: the last user message; rewards: any prompt or response) are
read here; [[mock:400]] is refused at once, before the rate limits (costing nothing), and
[[mock:garbage]] makes a 200 without a score: "I cannot decide." / {"scores": "nope"}.
One bad item sinks a whole rewards call, so a client must split the batch to isolate it.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .settings import MockJudgeSettings
from .verdicts import GROUP_FAULTS, answer, rm_verdict

Json = dict[str, Any]

_TRIGGERS = ("400", "hang-once", "hang", "500-once", "500", "badjson", "garbage",
             *(f"group-{f}" for f in GROUP_FAULTS))
_TRIGGER = re.compile(rf"\[\[mock:({'|'.join(_TRIGGERS)})\]\]")
_BAD_JSON = b'{"id": "chatcmpl-broken", "object": "chat.completion", "choices": [{"mess'
_completion_ids = itertools.count(1)


def _tokens(chars: int) -> int:
    return math.ceil(chars / 4)


def _error(message: str, kind: str, code: str | None = None) -> Json:
    return {"error": {"message": message, "type": kind, "code": code}}


class _BadRequest(Exception):
    """A client error; its message names the offending field."""


@dataclass
class _Call:
    """A validated scoring request: what it costs, which triggers it holds, how to answer it."""

    tokens: int
    triggers: set[str]
    items: int
    reply: Callable[[], Json]
    usage: tuple[int, int] = (0, 0)  # prompt and completion tokens its reply reports
    text: str = ""  # the judged text (a chat call's), for [[mock:hang-once]], [[mock:500-once]]


def _load_object(body: bytes) -> Json:
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        raise _BadRequest("request body is not valid JSON") from None
    if not isinstance(payload, dict):
        raise _BadRequest("request body must be a JSON object")
    return payload


def _require_strings(value: Any, where: str, keys: tuple[str, ...]) -> None:
    if not isinstance(value, dict):
        raise _BadRequest(f"'{where}' must be an object")
    for key in keys:
        if not isinstance(value.get(key), str):
            raise _BadRequest(f"'{where}.{key}' must be a string")


def _triggers(text: str, where: str) -> set[str]:
    found = set(_TRIGGER.findall(text))
    if "400" in found:
        raise _BadRequest(f"'{where}' contains [[mock:400]]")
    return found


def _parse_chat(body: bytes, settings: MockJudgeSettings) -> _Call:
    payload = _load_object(body)
    model = payload.get("model")
    if not isinstance(model, str):
        raise _BadRequest("'model' must be a string")
    messages = payload.get("messages")
    if not isinstance(messages, list):
        raise _BadRequest("'messages' must be a list")
    for i, message in enumerate(messages):
        _require_strings(message, f"messages[{i}]", ("role", "content"))
    users = [i for i, message in enumerate(messages) if message["role"] == "user"]
    if not users:
        raise _BadRequest("'messages' has no message with role 'user'")
    max_tokens = payload.get("max_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise _BadRequest("'max_tokens' must be a positive integer")

    judged = messages[users[-1]]["content"]
    triggers = _triggers(judged, f"messages[{users[-1]}].content")
    structured = isinstance(payload.get("response_format"), dict)
    content, items = answer(judged, triggers, structured, settings)
    prompt_chars = sum(len(message["content"]) for message in messages)
    prompt_tokens = math.ceil(prompt_chars / settings.token_chars)
    completion_tokens = math.ceil(len(content) / settings.token_chars)

    def reply() -> Json:
        return {
            "id": f"chatcmpl-{next(_completion_ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
            **({"usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            }} if settings.usage else {}),
        }

    cost = prompt_tokens + (max_tokens or completion_tokens)
    return _Call(tokens=cost, triggers=triggers, items=items, reply=reply,
                 usage=(prompt_tokens, completion_tokens), text=judged)


def _parse_rewards(body: bytes) -> _Call:
    items = _load_object(body).get("items")
    if not isinstance(items, list):
        raise _BadRequest("'items' must be a list")
    triggers: set[str] = set()
    for i, item in enumerate(items):
        _require_strings(item, f"items[{i}]", ("prompt", "response"))
        for key in ("prompt", "response"):
            triggers |= _triggers(item[key], f"items[{i}].{key}")
    tokens = sum(_tokens(len(item["prompt"]) + len(item["response"])) for item in items)
    usage = {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}
    garbage = "garbage" in triggers
    scores = "nope" if garbage else [rm_verdict(item["prompt"], item["response"]) for item in items]
    reply = {"scores": scores, "usage": usage}
    scored = 0 if garbage else len(items)
    return _Call(tokens=tokens, triggers=triggers, items=scored, reply=lambda: reply,
                 usage=(tokens, 0))


def _completion_call(body: bytes, settings: MockJudgeSettings) -> _Call:
    """A legacy text completion, judged as a chat call whose one user message is its prompt;
    its reply a text_completion."""
    payload = _load_object(body)
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _BadRequest("'prompt' must be a string (or a list of one string)")
    chat = {**payload, "messages": [{"role": "user", "content": prompt}]}
    del chat["prompt"]
    call = _parse_chat(json.dumps(chat).encode(), settings)
    chat_reply = call.reply
    call.reply = lambda: _as_text_completion(chat_reply())
    return call


def _as_text_completion(chat_reply: Json) -> Json:
    """A chat.completion reply as a text_completion."""
    choice = chat_reply["choices"][0]
    return {
        "id": chat_reply["id"].replace("chatcmpl-", "cmpl-", 1),
        "object": "text_completion",
        "created": chat_reply["created"],
        "model": chat_reply["model"],
        "choices": [{"text": choice["message"]["content"], "index": 0, "logprobs": None,
                     "finish_reason": choice["finish_reason"]}],
        **{k: v for k, v in chat_reply.items() if k == "usage"},
    }
