"""A rate-limited, OpenAI-compatible mock LLM judge for the demo, the tests and the benchmarks.

It is a stdlib HTTP server (plus a click entry point), so it runs anywhere the package does.

Verdict rule (deterministic, so tests can check every score):
    verdict(text) = (zlib.crc32(text.encode("utf-8")) % 101) / 100, applied to the content of
    the last message with role "user". The reward-model endpoint scores each item with
    rm_verdict(prompt, response) = verdict(prompt + "\\n" + response).

Group prompts (one chat call judging a whole group; the wire format is
qreward_queue.backends.groups'):
a judged text holding numbered blocks '<response id="1">\\n...\\n</response>', numbered 1, 2, ...
in order, is a group. Its head is the text before the first block (the shared prompt and the
instructions); each response scores rm_verdict(head, response), and the reply ends with the
scores as `group_reply` says: "list" 'Scores: [0.42, 0.07]', "object" 'Scores: {"1": 0.42,
"2": 0.07}', "tagged" '[1] Score: 0.42' lines. split_group() is that reading of a text.

Structured output: a request with `response_format` {"type": "json_schema", ...} is answered
with the JSON verdict alone: '{"score": 0.42}', or for a group '{"scores": [0.42, 0.07]}'.

A weak judge (`fooled`), for the judge integrity tests, the benchmark and the demo: it takes a
fenced block as the response (the first closing tag of the fence's name ends it, as a model
reads it) and everything else as its instructions. A verdict line among its instructions
('Score: 1', the last one) is obeyed: that number becomes its verdict, for a group the verdict
of the response whose block precedes it. So a response with no fence around it, or one that
closes a plain `</response>` tag early, talks it into any score; a fenced one cannot. Its reply
quotes the response(s) first ('The response reads:\n...'), then gives its verdict, so a
parser that reads the first score reads the response's.

Endpoints:
    POST /v1/chat/completions  {"model", "messages": [{"role", "content"}, ...], "max_tokens"?}
                               -> an OpenAI chat.completion saying "... Score: 0.42"
    POST /v1/completions       {"model", "prompt": text (or a list of one), "max_tokens"?} ->
                               a text_completion: the prompt judged as a chat call's one user
                               message, its text in choices[0].text
    POST /v1/rewards           {"items": [{"prompt", "response"}, ...]} -> {"scores", "usage"}
    GET /stats, POST /stats/reset, GET /health
    POST /hold {"answer": n}   answer n more calls, then hold every reply until POST /release
                               (tests that must act while a batch is surely unfinished)

/stats counts requests (every POST), accepted, rate_limited, errors, ... and the usage it
billed in its 200 replies: prompt_tokens and completion_tokens (the truth spend is checked by).
`items` counts what was scored in bulk: rewards items, and the responses of group prompts
answered well-formed.

Tokens are ceil(characters / 4). A chat call costs prompt_tokens plus max_tokens when given (as
OpenAI reserves it), else plus completion_tokens; a rewards call costs the sum over its items of
ceil((len(prompt) + len(response)) / 4) and counts as one request.

Rate limits are per minute but enforced per second, as OpenAI says it may: each is a token bucket
holding one second's worth (limit / 60) that refills continuously. A request is admitted when the
bucket holds its cost. A request costing more than the whole bucket is admitted only when the
bucket is full, and drives the level negative, so the long-run rate still holds (this is also what
makes rpm < 60 work). A concurrency limit caps the requests in flight. All checks happen on
arrival, under one lock, before the simulated latency, and a 429 consumes nothing. The
x-ratelimit-remaining-* headers count what is left in the one-second bucket (never below 0);
x-ratelimit-reset-* is the time until it is full, as a Go-style duration like OpenAI's ("20ms",
"1.5s", "6m0s"). A concurrency 429 has no bucket to wait for, so it says to retry after one mean
latency.

Faults: error_rate and hang_rate are drawn per admitted request from the seeded RNG. Triggers in
the judged text (chat: the last user message; rewards: any prompt or response), in this order:
    [[mock:400]]      400 invalid_request_error, checked before the rate limits (costs nothing)
    [[mock:hang]]     sleep hang_s first, then answer as below
    [[mock:hang-once]]  the same, only for the first request that judges this text
    [[mock:500]]      500 server_error
    [[mock:badjson]]  200 whose body is not JSON
    [[mock:garbage]]  200 without a score: "I cannot decide." / {"scores": "nope"}
One bad item sinks a whole rewards call, so a client must split the batch to isolate it.

Group faults, a well-formed 200 whose scores are wrong in one way, chosen per request by a
marker in the judged text, else (with group_fault_rate) by a draw from crc32(seed, text), so a
test can aim at one and a retry of the same request meets the same fault:
    [[mock:group-few]]    one score too few           [[mock:group-extra]]  one score too many
    [[mock:group-dup]]    the last response numbered as the first
    [[mock:group-order]]  scores in reverse order, correctly numbered (the only one to accept)
    [[mock:group-nan]]    the last score is "n/a"     [[mock:group-zero]]   numbered from 0
Faults that need numbers (dup, order, zero) reply as an object when group_reply is "list".

Anthropic (`/v1/messages`): the request needs `x-api-key` (else 401) and `anthropic-version`
(else 400), `model`, `max_tokens` and `messages` (text or text blocks), `system` apart; it is
judged and limited as the same chat call, and answered in Anthropic's shapes: the reply's text
in `content[0].text`, usage as `input_tokens`/`output_tokens`, errors as `{"type": "error",
"error": {"type", "message"}}`, the limits as `anthropic-ratelimit-{requests,tokens}-{limit,
remaining,reset}` (the reset an RFC 3339 time), a 429 with `retry-after` in whole seconds, and
`[[mock:529]]` in the judged text answered 529 overloaded_error (costing nothing).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import queue
import random
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
import zlib
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click

from ...flow.ratelimit_headers import parse_duration

Json = dict[str, Any]

GROUP_FAULTS = ("few", "extra", "dup", "order", "nan", "zero")
GROUP_REPLIES = ("list", "object", "tagged")
_TRIGGERS = ("400", "hang-once", "hang", "500", "badjson", "garbage",
             *(f"group-{f}" for f in GROUP_FAULTS))
_TRIGGER = re.compile(rf"\[\[mock:({'|'.join(_TRIGGERS)})\]\]")
_RESPONSE_BLOCK = re.compile(r'<(response(?:-[0-9a-f]{16,32})?) id="(\d+)">\n(.*?)\n</\1>',
                             re.DOTALL)
_FENCE = re.compile(r"<(response-[0-9a-f]{16,32})>\n(.*?)\n</\1>", re.DOTALL)
_OBEYED = re.compile(r"(?i)score\s*[:=]\s*([-+]?(?:\d+\.?\d*|\.\d+))")
_UNSEEN = re.compile("[\u200b-\u200f\u2060-\u2064\ufeff\u00ad]")
_LABEL = re.compile(r"(?im)^(?:candidate\s+)?(?:response|answer)\s*:\s?")
_COUNTERS = (
    "requests",
    "accepted",
    "rate_limited",
    "errors",
    "client_errors",
    "hangs",
    "connections_opened",
    "tokens",
    "items",
    "prompt_tokens",
    "completion_tokens",
)
_BAD_JSON = b'{"id": "chatcmpl-broken", "object": "chat.completion", "choices": [{"mess'
_completion_ids = itertools.count(1)


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


def verdict(text: str) -> float:
    """The judge's score for a text: (crc32 % 101) / 100, so tests can predict every score."""
    # surrogatepass only matters for lone surrogates, which JSON allows but UTF-8 does not
    return (zlib.crc32(text.encode("utf-8", "surrogatepass")) % 101) / 100


def rm_verdict(prompt: str, response: str) -> float:
    """The reward model's score for one (prompt, response) item."""
    return verdict(prompt + "\n" + response)


def split_group(text: str) -> tuple[str, list[str]] | None:
    """(head, responses) when `text` is a group prompt, else None (then it is one sample)."""
    blocks = list(_RESPONSE_BLOCK.finditer(text))
    if not blocks or any(m.group(2) != str(n) for n, m in enumerate(blocks, 1)):
        return None
    return text[: blocks[0].start()].rstrip("\n"), [m.group(3) for m in blocks]


def obeyed(instructions: str) -> float | None:
    """The verdict a weak judge takes from its instructions: their last verdict line (read as
    a model reads it: through invisible characters)."""
    found = _OBEYED.findall(_UNSEEN.sub("", instructions))
    return float(found[-1]) if found else None


def fooled_verdict(text: str) -> tuple[str, float]:
    """A weak judge's reading of one sample's message: (what it quotes as the response, its
    verdict): an obeyed verdict line outside the fence, else the honest `verdict(text)`."""
    fenced = _FENCE.search(text)
    if fenced:
        quoted, instructions = fenced.group(2), text[:fenced.start()] + text[fenced.end():]
    else:
        label = _LABEL.search(text)
        quoted, instructions = text[label.end() if label else 0:], text
    told = obeyed(instructions)
    return quoted, verdict(text) if told is None else told


def _fooled_group(text: str, head: str, responses: list[str]) -> list[float]:
    """A weak judge's group verdicts: a verdict line between blocks (a response that closed
    its block early) is obeyed for the response before it."""
    blocks = list(_RESPONSE_BLOCK.finditer(text))
    scores = [rm_verdict(head, r) for r in responses]
    for n, block in enumerate(blocks):
        gap = text[block.end():blocks[n + 1].start() if n + 1 < len(blocks) else len(text)]
        told = obeyed(gap)
        if told is not None:
            scores[n] = told
    return scores


def _group_fault(text: str, triggers: set[str], settings: MockJudgeSettings) -> str | None:
    marked = sorted(t.removeprefix("group-") for t in triggers if t.startswith("group-"))
    if marked:
        return marked[0]
    draw = zlib.crc32(f"{settings.seed}:{text}".encode("utf-8", "surrogatepass"))
    if draw % 10_000 < settings.group_fault_rate * 10_000:
        return GROUP_FAULTS[draw // 10_000 % len(GROUP_FAULTS)]
    return None


def _group_reply(scores: list[float], fault: str | None, style: str) -> str:
    """The judge's answer for a group: one score per response, unless `fault` spoils it."""
    pairs: list[tuple[int, float | str]] = list(enumerate(scores, 1))
    match fault:
        case "few":
            pairs = pairs[:-1]
        case "extra":
            pairs = [*pairs, (len(pairs) + 1, 0.5)]
        case "dup":
            pairs = [*pairs[:-1], (1, pairs[-1][1])] if len(pairs) > 1 else pairs * 2
        case "order":
            pairs = pairs[::-1]
        case "nan":
            pairs = [*pairs[:-1], (pairs[-1][0], "n/a")]
        case "zero":
            pairs = [(n - 1, score) for n, score in pairs]
    if style == "list" and fault in ("dup", "order", "zero"):
        style = "object"
    if style == "tagged":
        return "\n".join(f"[{n}] Score: {score}" for n, score in pairs)
    if style == "object":
        fields = ", ".join(f'"{n}": {json.dumps(score)}' for n, score in pairs)  # keeps duplicates
        return f"Scores: {{{fields}}}"
    return f"Scores: {json.dumps([score for _, score in pairs])}"


def _tokens(chars: int) -> int:
    return math.ceil(chars / 4)


def _ceil_ms(seconds: float) -> int:
    # round off float noise first, so 0.1 s is 100 ms and not 101
    return math.ceil(round(seconds * 1000, 6))


def _duration(seconds: float) -> str:
    """Format like OpenAI's x-ratelimit-reset-* headers: "20ms", "1s", "1.5s", "6m0s", "1h0m0s"."""
    ms = _ceil_ms(seconds)
    if 0 < ms < 1000:
        return f"{ms}ms"
    minutes, ms = divmod(ms, 60_000)
    hours, minutes = divmod(minutes, 60)
    text = f"{ms / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    return f"{hours}h{text}" if hours else text


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _error(message: str, kind: str, code: str | None = None) -> Json:
    return {"error": {"message": message, "type": kind, "code": code}}


class _BadRequest(Exception):
    """A client error; its message names the offending field."""


class _Bucket:
    """Token bucket holding one second's worth of a per-minute limit."""

    def __init__(self, per_minute: float, now: float) -> None:
        self.per_minute = per_minute
        self.rate = per_minute / 60
        self.capacity = self.rate
        self.level = self.capacity
        self.stamp = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def admits(self, cost: float) -> bool:
        return self.level >= min(cost, self.capacity)

    def wait_for(self, cost: float) -> float:
        return max(0.0, min(cost, self.capacity) - self.level) / self.rate

    def headers(self, kind: str) -> dict[str, str]:
        return {
            f"x-ratelimit-limit-{kind}": _number(self.per_minute),
            f"x-ratelimit-remaining-{kind}": str(max(0, math.floor(self.level))),
            f"x-ratelimit-reset-{kind}": _duration((self.capacity - self.level) / self.rate),
        }


@dataclass
class _Call:
    """A validated scoring request: what it costs, which triggers it holds, how to answer it."""

    tokens: int
    triggers: set[str]
    items: int
    reply: Callable[[], Json]
    usage: tuple[int, int] = (0, 0)  # prompt and completion tokens its reply reports
    text: str = ""  # the judged text (a chat call's), for [[mock:hang-once]]


@dataclass
class _Ticket:
    """The outcome of admission: a refusal (kind, message, seconds to wait) or the random draws."""

    headers: dict[str, str]
    refusal: tuple[str, str, float] | None = None
    latency_s: float = 0.0
    error: bool = False
    hang: bool = False


class _Judge:
    """Limits, counters and the seeded RNG shared by all handler threads, behind one lock."""

    def __init__(self, settings: MockJudgeSettings) -> None:
        self.settings = settings
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._hung_once: set[str] = set()
        self._rng = random.Random(settings.seed)
        now = time.monotonic()
        self._requests = _Bucket(settings.rpm, now) if settings.rpm > 0 else None
        self._tokens = _Bucket(settings.tpm, now) if settings.tpm > 0 else None
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._in_flight = 0
        self._peak = 0
        self._gate = threading.Condition()
        self._answers_left: int | None = None  # None: answer all; n: n more, then hold

    def hold_after(self, answers: int | None) -> None:
        """Answer `answers` more admitted calls, then hold every reply until
        `hold_after(None)`: a test then knows its batch cannot finish before it says so."""
        with self._gate:
            self._answers_left = answers
            self._gate.notify_all()

    def wait_turn(self) -> None:
        """An admitted call's turn to be answered (at once unless held)."""
        with self._gate:
            while self._answers_left == 0 and not self.stopping.is_set():
                self._gate.wait()
            if self._answers_left:
                self._answers_left -= 1

    def count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount

    def first_time(self, text: str) -> bool:
        """Whether no request has judged `text` before ([[mock:hang-once]])."""
        with self._lock:
            seen = text in self._hung_once
            self._hung_once.add(text)
            return not seen

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self._counts, "in_flight": self._in_flight, "peak_in_flight": self._peak}

    def reset(self) -> None:
        with self._lock:
            self._counts = dict.fromkeys(_COUNTERS, 0)
            self._peak = self._in_flight

    def pause(self, seconds: float) -> None:
        """Sleep, but wake up when the server stops so hanging handlers do not outlive it."""
        if seconds > 0:
            self.stopping.wait(seconds)

    def admit(self, tokens: int) -> _Ticket:
        """Check every limit at arrival; on success take the cost and draw latency and faults."""
        with self._lock:
            now = time.monotonic()
            for bucket in (self._requests, self._tokens):
                if bucket:
                    bucket.refill(now)
            ticket = _Ticket(headers={}, refusal=self._refusal(tokens))
            if ticket.refusal is None:
                if self._requests:
                    self._requests.level -= 1
                if self._tokens:
                    self._tokens.level -= tokens
                self._in_flight += 1
                self._peak = max(self._peak, self._in_flight)
                self._counts["tokens"] += tokens
                ticket.latency_s = self._draw_latency()
                ticket.error = self._rng.random() < self.settings.error_rate
                ticket.hang = self._rng.random() < self.settings.hang_rate
            if self._requests:
                ticket.headers |= self._requests.headers("requests")
            if self._tokens:
                ticket.headers |= self._tokens.headers("tokens")
            return ticket

    def release(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def _refusal(self, tokens: int) -> tuple[str, str, float] | None:
        if self._requests and not self._requests.admits(1):
            limit = _number(self._requests.per_minute)
            message = f"Rate limit reached for requests per min (RPM): Limit {limit}"
            return "requests", message, self._requests.wait_for(1)
        if self._tokens and not self._tokens.admits(tokens):
            limit = f"Limit {_number(self._tokens.per_minute)}, Requested {tokens}"
            message = f"Rate limit reached for tokens per min (TPM): {limit}"
            return "tokens", message, self._tokens.wait_for(tokens)
        most = self.settings.max_concurrent
        if most > 0 and self._in_flight >= most:
            message = f"Rate limit reached for concurrency: Limit {most} requests in flight"
            return "concurrency", message, self.settings.latency_ms / 1000
        return None

    def _draw_latency(self) -> float:
        mean, cv = self.settings.latency_ms / 1000, self.settings.latency_cv
        if 0 < self.settings.degrade_above < self._in_flight:  # an overloaded server
            mean *= 2
        if mean <= 0 or cv <= 0:
            return max(mean, 0.0)
        sigma2 = math.log1p(cv * cv)
        return self._rng.lognormvariate(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))


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
    group = split_group(judged)
    structured = isinstance(payload.get("response_format"), dict)
    items = 0
    if "garbage" in triggers:
        content = "I cannot decide."
    elif group:
        head, responses = group
        fault = _group_fault(judged, triggers, settings)
        scores = _fooled_group(judged, head, responses) if settings.fooled else \
            [rm_verdict(head, r) for r in responses]
        content = _group_reply(scores, fault, settings.group_reply)
        if structured and fault is None:
            content = json.dumps({"scores": scores})
        elif settings.fooled:
            quotes = "".join(f"Response {n} reads:\n{r}\n" for n, r in enumerate(responses, 1))
            content = quotes + content
        items = len(responses) if fault in (None, "order") else 0
    else:
        quoted, score = fooled_verdict(judged) if settings.fooled else ("", verdict(judged))
        content = (json.dumps({"score": round(score, 2)}) if structured
                   else f"The response reads:\n{quoted}\nScore: {score:.2f}" if settings.fooled
                   else f"The response was assessed. Score: {score:.2f}")
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


def _anthropic_call(body: bytes, settings: MockJudgeSettings) -> _Call:
    """A Messages request, judged as the chat call it is, its reply an Anthropic message."""
    call = _parse_chat(_messages_as_chat(body), settings)
    chat_reply = call.reply
    call.reply = lambda: _as_message(chat_reply())
    return call


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


class _Server(ThreadingHTTPServer):
    """One thread per connection, with a backlog deep enough for bursts of ~200 clients."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 1024

    def __init__(self, settings: MockJudgeSettings) -> None:
        self.judge = _Judge(settings)
        super().__init__((settings.host, settings.port), _Handler)
        if settings.tls_cert:  # each connection's handshake on its own thread, at first read
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(settings.tls_cert, settings.tls_key or None)
            self.socket = context.wrap_socket(self.socket, server_side=True,
                                              do_handshake_on_connect=False)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client hanging up is not news
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    disable_nagle_algorithm = True  # headers and body go out as separate writes
    server: _Server
    anthropic = False  # this request came to /v1/messages: answered in Anthropic's shapes

    def setup(self) -> None:
        super().setup()
        self.server.judge.count("connections_opened")

    def log_message(self, format: str, *args: Any) -> None:
        """Stay quiet: benchmarks send thousands of requests."""

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        judge = self.server.judge
        path = urlsplit(self.path).path
        self.anthropic = path == "/v1/messages"
        try:
            body = self._read_body()
        except _BadRequest as exc:
            self.close_connection = True  # the next request's start is unknown
            self._send_json(400, _error(str(exc), "invalid_request_error"))
            return
        match self.command, path:
            case "POST", "/v1/chat/completions":
                self._score(body, lambda chat: _parse_chat(chat, judge.settings))
            case "POST", "/v1/completions":
                self._score(body, lambda raw: _completion_call(raw, judge.settings))
            case "POST", "/v1/rewards":
                self._score(body, _parse_rewards)
            case "POST", "/v1/messages":
                self._messages(body)
            case "GET", "/stats":
                self._send_json(200, judge.stats())
            case "POST", "/stats/reset":
                judge.reset()
                self._send_json(200, judge.stats())
            case "POST", "/hold":
                judge.hold_after(int(json.loads(body or b"{}").get("answer", 0)))
                self._send_json(200, judge.stats())
            case "POST", "/release":
                judge.hold_after(None)
                self._send_json(200, judge.stats())
            case "GET", "/health":
                self._send_json(200, {"ok": True})
            case _:
                message = f"unknown endpoint: {self.command} {path}"
                self._send_json(404, _error(message, "invalid_request_error"))

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise _BadRequest("chunked request bodies are not supported; send Content-Length")
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = -1
        if length < 0:
            raise _BadRequest("'Content-Length' header must be a non-negative integer")
        return self.rfile.read(length)

    def _score(self, body: bytes, parse: Callable[[bytes], _Call]) -> None:
        judge = self.server.judge
        judge.count("requests")
        try:
            call = parse(body)
        except _BadRequest as exc:
            judge.count("client_errors")
            self._send_json(400, _error(str(exc), "invalid_request_error"))
            return
        ticket = judge.admit(call.tokens)
        if ticket.refusal:
            judge.count("rate_limited")
            kind, message, wait = ticket.refusal
            ms = max(1, _ceil_ms(wait))
            message = f"{message}. Please try again in {_duration(wait)}."
            headers = {
                **ticket.headers,
                "Retry-After": str(max(1, math.ceil(ms / 1000))),
                "retry-after-ms": str(ms),
            }
            self._send_json(429, _error(message, kind, "rate_limit_exceeded"), headers)
            return
        try:
            status, response = self._answer(call, ticket)
        finally:
            judge.release()  # before replying, so a client's next request finds the slot free
        self._send(status, response, ticket.headers)

    def _messages(self, body: bytes) -> None:
        """Anthropic's Messages API: its headers checked, then judged as the chat route."""
        judge = self.server.judge
        if not self.headers.get("x-api-key"):
            judge.count("client_errors")
            self._send_json(401, _error("x-api-key header is required", "authentication_error"))
        elif not self.headers.get("anthropic-version"):
            judge.count("client_errors")
            self._send_json(400, _error("anthropic-version header is required", "invalid"))
        elif b"[[mock:529]]" in body:
            judge.count("requests")
            judge.count("rate_limited")
            self._send_json(529, _error("Overloaded", "overloaded_error"))
        else:
            self._score(body, lambda raw: _anthropic_call(raw, judge.settings))

    def _answer(self, call: _Call, ticket: _Ticket) -> tuple[int, bytes]:
        """Sit out the simulated latency and faults of an admitted call, then build its reply."""
        judge = self.server.judge
        judge.wait_turn()
        judge.pause(ticket.latency_s)
        if ticket.hang or "hang" in call.triggers or (
                "hang-once" in call.triggers and judge.first_time(call.text)):
            judge.count("hangs")
            judge.pause(judge.settings.hang_s)
        if ticket.error or "500" in call.triggers:
            judge.count("errors")
            message = "The server had an error while processing your request."
            return 500, json.dumps(_error(message, "server_error")).encode()
        judge.count("accepted")
        if "badjson" in call.triggers:
            return 200, _BAD_JSON
        judge.count("items", call.items)
        judge.count("prompt_tokens", call.usage[0])
        judge.count("completion_tokens", call.usage[1])
        return 200, json.dumps(call.reply()).encode()

    def _send_json(self, status: int, payload: Json, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(payload).encode(), headers or {})

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        if self.anthropic:
            body, headers = _anthropic_reply(status, body, headers)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)


class MockJudge:
    """The mock judge in this process, serving from a daemon thread; binds its port at once."""

    def __init__(self, settings: MockJudgeSettings | None = None) -> None:
        self.settings = settings or MockJudgeSettings()
        self._server = _Server(self.settings)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        scheme = "https" if self.settings.tls_cert else "http"
        # typeshed allows a bytes host (AF_UNIX); this AF_INET server's is a str
        return f"{scheme}://{host}:{port}"  # type: ignore[str-bytes-safe]

    def start(self) -> MockJudge:
        if self._thread is None:
            # a short poll interval keeps stop() fast; shutdown() waits for the next poll
            self._thread = threading.Thread(
                target=self._server.serve_forever,
                kwargs={"poll_interval": 0.05},
                name="mock-judge",
                daemon=True,
            )
            self._thread.start()
        return self

    def stats(self) -> dict[str, int]:
        return self._server.judge.stats()

    def reset(self) -> None:
        self._server.judge.reset()

    def hold(self, answer: int = 0) -> None:
        """Answer `answer` more calls, then hold every reply until `release()`."""
        self._server.judge.hold_after(answer)

    def release(self) -> None:
        self._server.judge.hold_after(None)

    def stop(self) -> None:
        self.release()
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()
        self._server.judge.stopping.set()

    def __enter__(self) -> MockJudge:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class MockJudgeProcess:
    """The mock judge in a subprocess, so it has its own GIL and CPU time; see spawn()."""

    def __init__(self, process: subprocess.Popen[str], url: str) -> None:
        self.process = process
        self.url = url

    def stats(self) -> dict[str, int]:
        with urllib.request.urlopen(f"{self.url}/stats", timeout=10) as response:
            return json.load(response)

    def reset(self) -> None:
        """Zero the counters, e.g. between two runs against the same server."""
        self._post("/stats/reset", b"")

    def hold(self, answer: int = 0) -> None:
        """Answer `answer` more calls, then hold every reply until `release()`."""
        self._post("/hold", json.dumps({"answer": answer}).encode())

    def release(self) -> None:
        self._post("/release", b"")

    def _post(self, path: str, body: bytes) -> None:
        request = urllib.request.Request(f"{self.url}{path}", data=body, method="POST")
        urllib.request.urlopen(request, timeout=10).close()

    def kill(self) -> None:
        """SIGKILL, as a crash would: for failover tests."""
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.process.stdout:
            self.process.stdout.close()

    def __enter__(self) -> MockJudgeProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def spawn(settings: MockJudgeSettings | None = None, timeout_s: float = 10.0) -> MockJudgeProcess:
    """Run the mock judge as `python -m qreward_queue.testing.mock_judge` and wait for its URL."""
    settings = settings or MockJudgeSettings()
    options = []
    for field in fields(settings):
        name, value = field.name.replace("_", "-"), getattr(settings, field.name)
        options += [f"--{name}" if value else f"--no-{name}"] if isinstance(value, bool) \
            else [f"--{name}", str(value)]
    # make the package importable whatever the caller's working directory is
    paths = [str(Path(__file__).absolute().parents[3]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    process = subprocess.Popen(
        [sys.executable, "-m", "qreward_queue.testing.mock_judge", *options],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    stdout = process.stdout
    assert stdout is not None
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=timeout_s)
    except queue.Empty:
        line = None
    match = re.search(r"listening on (https?://\S+)", line or "")
    if match:
        return MockJudgeProcess(process, match.group(1))
    process.kill()
    process.wait()
    if line is None:
        raise RuntimeError(f"mock judge did not print its URL within {timeout_s:g} s")
    if not line:
        raise RuntimeError(f"mock judge exited with code {process.returncode} before starting")
    raise RuntimeError(f"mock judge printed {line.strip()!r} instead of its URL")


_DEFAULTS = MockJudgeSettings()


@click.command("mock-judge")
@click.option("--host", default=_DEFAULTS.host, show_default=True, help="Interface to bind.")
@click.option("--port", default=_DEFAULTS.port, show_default=True, help="0 picks a free port.")
@click.option("--rpm", type=float, default=_DEFAULTS.rpm, help="Requests/min, 0 = no limit.")
@click.option("--tpm", type=float, default=_DEFAULTS.tpm, help="Tokens/min, 0 = no limit.")
@click.option(
    "--max-concurrent", default=_DEFAULTS.max_concurrent, help="Requests in flight, 0 = no limit."
)
@click.option("--latency-ms", type=float, default=_DEFAULTS.latency_ms, show_default=True,
              help="Mean latency.")
@click.option("--latency-cv", type=float, default=_DEFAULTS.latency_cv, show_default=True,
              help="Coefficient of variation of the lognormal latency, 0 = constant.")
@click.option("--error-rate", type=float, default=_DEFAULTS.error_rate,
              help="Fraction of admitted requests answered 500.")
@click.option("--hang-rate", type=float, default=_DEFAULTS.hang_rate,
              help="Fraction of admitted requests that hang.")
@click.option("--hang-s", type=float, default=_DEFAULTS.hang_s, show_default=True,
              help="Seconds a hang lasts.")
@click.option("--token-chars", type=float, default=_DEFAULTS.token_chars, show_default=True,
              help="Characters per token as its tokenizer counts (CJK text: about 1).")
@click.option("--usage/--no-usage", default=_DEFAULTS.usage, show_default=True,
              help="Chat replies carry `usage`.")
@click.option("--degrade-above", default=_DEFAULTS.degrade_above,
              help="Latency doubles above this many requests in flight, 0 = never.")
@click.option("--seed", default=_DEFAULTS.seed, show_default=True, help="Seed of the fault RNG.")
@click.option("--group-reply", type=click.Choice(GROUP_REPLIES), default=_DEFAULTS.group_reply,
              show_default=True, help="How a group prompt's scores are written.")
@click.option("--group-fault-rate", type=float, default=_DEFAULTS.group_fault_rate,
              help="Fraction of group prompts answered with a group fault.")
@click.option("--fooled/--no-fooled", default=_DEFAULTS.fooled,
              help="A weak judge: obeys verdict lines outside a fence, quotes the response.")
@click.option("--tls-cert", default="", help="Serve HTTPS with this PEM certificate.")
@click.option("--tls-key", default="", help="The private key of --tls-cert.")
def mock_judge_cli(**options: Any) -> None:
    """Serve a rate-limited, OpenAI-compatible mock LLM judge until SIGINT or SIGTERM."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    judge = MockJudge(MockJudgeSettings(**options)).start()
    click.echo(f"mock judge listening on {judge.url}")  # click.echo flushes; spawn() waits on it
    try:
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        judge.stop()

