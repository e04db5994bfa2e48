"""A judge sends a gateway's request as it came (its own model; a text completion to its
completions endpoint) and hands back the reply's bytes; its templated samples are untouched."""

from __future__ import annotations

import json

import pytest

from qreward_queue.backends import JudgeOptions
from qreward_queue.backends.judge import JudgeBackend
from qreward_queue.backends.passthrough import COMPLETIONS, ENDPOINT, REQUEST
from qreward_queue.backends.transport import Reply
from qreward_queue.config.model import Backend
from qreward_queue.errors import PermanentError

JUDGE = JudgeBackend(Backend(name="j", kind="judge", options=JudgeOptions(
    url="http://127.0.0.1:1/v1", model="judge-model", max_tokens=16)))
BODY = {"model": "qrq/route", "messages": [{"role": "user", "content": "x" * 400}],
        "max_tokens": 100, "temperature": 0.5, "logprobs": True}
CHAT = {"prompt": "", "response": "", "extra": {REQUEST: BODY, "request": "r1"}}


def test_the_callers_body_goes_out_with_the_judges_model():
    assert JUDGE.request([CHAT]) == {**BODY, "model": "judge-model"}
    tokens_in, tokens_out = JUDGE.estimate_usage([CHAT])
    assert tokens_in > 100 and tokens_out == 100  # the messages, the caller's max_tokens


def test_a_text_completion_goes_to_the_completions_endpoint():
    body = {"model": "route", "prompt": "y" * 400, "max_tokens": 30}
    text = {"prompt": "", "response": "",
            "extra": {REQUEST: body, ENDPOINT: COMPLETIONS, "request": "r2"}}
    assert JUDGE.url([text]) == "http://127.0.0.1:1/v1/completions"
    assert JUDGE.url([CHAT]) == "http://127.0.0.1:1/v1/chat/completions"
    assert JUDGE.request([text]) == {**body, "model": "judge-model"}
    tokens_in, tokens_out = JUDGE.estimate_usage([text])
    assert 100 <= tokens_in < 110 and tokens_out == 30  # the prompt, the caller's max_tokens
    assert JUDGE.input_bytes([text]) == len(json.dumps(body["prompt"]))
    claude = JudgeBackend(Backend(name="c", kind="judge", options=JudgeOptions(
        url="http://127.0.0.1:1/v1", model="claude", dialect="anthropic")))
    with pytest.raises(PermanentError, match="anthropic dialect has no text completions"):
        claude.url([text])


def test_the_reply_comes_back_byte_for_byte_with_its_usage():
    raw = '{"usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},\n' \
          '  "choices": [{"message": {"content": "très"}}]}'.encode()
    call = JUDGE.answer([CHAT], Reply(200, {}, json.loads(raw), raw))
    assert call.details == [raw.decode()] and call.scores == [0.0]
    assert call.usage == (3, 2) and call.tokens == 5


def test_a_templated_sample_is_judged_as_before():
    sample = {"prompt": "2+2?", "response": "4"}
    payload = JUDGE.request([sample])
    assert payload["model"] == "judge-model" and "2+2?" in payload["messages"][-1]["content"]
