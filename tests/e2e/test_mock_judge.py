"""The mock judge over real HTTP on 127.0.0.1: verdicts, limits, faults, stats and robustness."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import socket
import statistics
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests
from support import wait_for

from qreward_queue.backends.groups import (
    DEFAULT_GROUP_TEMPLATE,
    DEFAULT_TAGGED_PATTERN,
    parse_group_scores,
    render_group,
)
from qreward_queue.errors import PermanentError
from qreward_queue.testing.mock_judge import (
    GROUP_FAULTS,
    MockJudge,
    MockJudgeSettings,
    _Judge,
    rm_verdict,
    spawn,
    split_group,
    verdict,
)

CHAT = "/v1/chat/completions"
REWARDS = "/v1/rewards"


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "judge-1", "messages": [{"role": "user", "content": content}], **extra}


def rewards(*pairs: tuple[str, str]) -> dict[str, Any]:
    return {"items": [{"prompt": p, "response": r} for p, r in pairs]}


@pytest.fixture
def make_judge() -> Iterator[Callable[..., MockJudge]]:
    """Start judges with fast, constant latency unless a test asks otherwise; stop them after."""
    judges: list[MockJudge] = []

    def make(**overrides: Any) -> MockJudge:
        settings = MockJudgeSettings(**{"latency_ms": 1, "latency_cv": 0, **overrides})
        judges.append(MockJudge(settings).start())
        return judges[-1]

    yield make
    for judge in judges:
        judge.stop()


@pytest.fixture
def session() -> Iterator[requests.Session]:
    with requests.Session() as s:
        yield s


def test_verdict_rule_is_crc32_mod_101() -> None:
    assert verdict("") == 0.0
    assert verdict("hello") == (zlib.crc32(b"hello") % 101) / 100
    assert rm_verdict("p", "r") == verdict("p\nr")
    assert all(0.0 <= verdict(str(i)) <= 1.0 for i in range(500))


def test_chat_completion_shape_scores_last_user_message(make_judge, session) -> None:
    judge = make_judge()
    messages = [
        {"role": "system", "content": "You are a strict grader."},
        {"role": "user", "content": "Grade: 2+2=5"},
        {"role": "assistant", "content": "0.0"},
        {"role": "user", "content": "Grade: 2+2=4"},
    ]
    reply = session.post(judge.url + CHAT, json={"model": "m-7", "messages": messages})

    assert reply.status_code == 200
    body = reply.json()
    content = f"The response was assessed. Score: {verdict('Grade: 2+2=4'):.2f}"
    assert re.fullmatch(r"chatcmpl-\d+", body["id"])
    assert body["object"] == "chat.completion"
    assert body["model"] == "m-7"
    assert isinstance(body["created"], int)
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
    ]
    prompt_tokens = math.ceil(sum(len(m["content"]) for m in messages) / 4)
    completion_tokens = math.ceil(len(content) / 4)
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    assert "x-ratelimit-limit-requests" not in reply.headers  # no limit set, no headers


def test_text_completion_judges_its_prompt(make_judge, session) -> None:
    judge = make_judge(rpm=60)
    ask = {"model": "m-7", "prompt": ["Grade: 2+2=4"], "max_tokens": 20}
    reply = session.post(judge.url + "/v1/completions", json=ask)

    assert reply.status_code == 200, reply.text
    body = reply.json()
    text = f"The response was assessed. Score: {verdict('Grade: 2+2=4'):.2f}"
    assert re.fullmatch(r"cmpl-\d+", body["id"]) and body["object"] == "text_completion"
    assert body["model"] == "m-7" and isinstance(body["created"], int)
    assert body["choices"] == [{"text": text, "index": 0, "logprobs": None,
                                "finish_reason": "stop"}]
    prompt_tokens, completion_tokens = math.ceil(12 / 4), math.ceil(len(text) / 4)
    assert body["usage"] == {"prompt_tokens": prompt_tokens,
                             "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    assert "x-ratelimit-limit-requests" in reply.headers  # limited as a chat call
    bad = session.post(judge.url + "/v1/completions", json={"model": "m", "prompt": ["a", "b"]})
    assert bad.status_code == 400 and "'prompt'" in bad.json()["error"]["message"]
    assert judge.stats()["accepted"] == 1 and judge.stats()["client_errors"] == 1


def test_rewards_scores_every_item_in_order(make_judge, session) -> None:
    judge = make_judge()
    pairs = [(f"prompt {i}", "response " * i) for i in range(6)]
    reply = session.post(judge.url + REWARDS, json=rewards(*pairs))

    assert reply.status_code == 200
    assert reply.json()["scores"] == [rm_verdict(p, r) for p, r in pairs]
    tokens = sum(math.ceil((len(p) + len(r)) / 4) for p, r in pairs)
    assert reply.json()["usage"]["prompt_tokens"] == tokens
    stats = judge.stats()
    assert (stats["requests"], stats["accepted"], stats["items"], stats["tokens"]) == (
        1,
        1,
        6,
        tokens,
    )


def test_rpm_limit_answers_429_with_openai_headers(make_judge, session) -> None:
    judge = make_judge(rpm=120, tpm=60_000)  # buckets of 2 requests and 1000 tokens
    first, second, third = (session.post(judge.url + CHAT, json=chat("x")) for _ in range(3))

    assert (first.status_code, second.status_code, third.status_code) == (200, 200, 429)
    assert first.headers["x-ratelimit-limit-requests"] == "120"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert first.headers["x-ratelimit-reset-requests"] == "500ms"
    error = third.json()["error"]
    assert error["type"] == "requests"
    assert error["code"] == "rate_limit_exceeded"
    assert error["message"].startswith("Rate limit reached for requests")
    wait_ms = int(third.headers["retry-after-ms"])
    assert 0 < wait_ms <= 500
    assert int(third.headers["Retry-After"]) == 1
    assert third.headers["x-ratelimit-remaining-requests"] == "0"
    assert re.fullmatch(r"\d+ms|1s", third.headers["x-ratelimit-reset-requests"])
    assert third.headers["x-ratelimit-limit-tokens"] == "60000"
    stats = judge.stats()
    assert (stats["rate_limited"], stats["tokens"]) == (1, 2 * (1 + 10))  # a 429 costs nothing


def test_rpm_below_60_admits_one_request_per_period(make_judge, session) -> None:
    judge = make_judge(rpm=1)
    first = session.post(judge.url + CHAT, json=chat("x"))
    second = session.post(judge.url + CHAT, json=chat("x"))

    assert first.status_code == 200
    assert first.headers["x-ratelimit-reset-requests"] == "1m0s"
    assert second.status_code == 429
    assert second.headers["Retry-After"] == "60"


def test_tpm_limit_counts_tokens_not_requests(make_judge, session) -> None:
    judge = make_judge(tpm=240)  # a bucket of 4 tokens; each call below costs 2
    replies = [session.post(judge.url + REWARDS, json=rewards(("12345678", ""))) for _ in range(3)]

    assert [r.status_code for r in replies] == [200, 200, 429]
    assert replies[0].headers["x-ratelimit-remaining-tokens"] == "2"
    assert replies[-1].json()["error"]["type"] == "tokens"
    assert "Requested 2" in replies[-1].json()["error"]["message"]
    assert judge.stats()["tokens"] == 4


def test_request_bigger_than_tpm_bucket_passes_only_when_full(make_judge, session) -> None:
    judge = make_judge(tpm=600)  # 10-token bucket; this call costs 5 prompt + 10 max_tokens
    body = chat("x" * 20, max_tokens=10)
    first = session.post(judge.url + CHAT, json=body)
    second = session.post(judge.url + CHAT, json=body)

    assert first.status_code == 200
    assert first.headers["x-ratelimit-remaining-tokens"] == "0"
    assert first.headers["x-ratelimit-reset-tokens"] == "1.5s"  # from -5 back up to 10
    assert second.status_code == 429
    assert 1000 < int(second.headers["retry-after-ms"]) <= 1500
    assert second.headers["Retry-After"] == "2"


def test_headers_on_success(make_judge, session) -> None:
    judge = make_judge(rpm=6000, tpm=600_000)  # buckets of 100 requests and 10000 tokens
    reply = session.post(judge.url + CHAT, json=chat("x" * 20, max_tokens=10))

    assert reply.status_code == 200
    assert {k: v for k, v in reply.headers.items() if k.startswith("x-ratelimit")} == {
        "x-ratelimit-limit-requests": "6000",
        "x-ratelimit-remaining-requests": "99",
        "x-ratelimit-reset-requests": "10ms",
        "x-ratelimit-limit-tokens": "600000",
        "x-ratelimit-remaining-tokens": "9985",
        "x-ratelimit-reset-tokens": "2ms",
    }


def test_concurrency_limit(make_judge) -> None:
    judge = make_judge(max_concurrent=2, hang_s=1, latency_ms=5)
    statuses: list[int] = []

    def hang() -> None:
        statuses.append(requests.post(judge.url + CHAT, json=chat("[[mock:hang]]")).status_code)

    threads = [threading.Thread(target=hang) for _ in range(2)]
    for thread in threads:
        thread.start()
    wait_for(lambda: judge.stats()["in_flight"] >= 2, 10, "both hanging calls", interval_s=0.005)
    refused = requests.post(judge.url + CHAT, json=chat("x"))
    for thread in threads:
        thread.join()

    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "concurrency"
    assert refused.headers["Retry-After"] == "1"
    assert refused.headers["retry-after-ms"] == "5"
    assert statuses == [200, 200]
    stats = judge.stats()
    assert (stats["peak_in_flight"], stats["hangs"], stats["in_flight"]) == (2, 2, 0)


def test_stats_counts_and_keep_alive(make_judge, session) -> None:
    judge = make_judge()
    for _ in range(20):
        session.post(judge.url + CHAT, json=chat("hello"))
    session.post(judge.url + CHAT, json=chat("[[mock:500]]"))
    session.post(judge.url + CHAT, json={"model": "m"})
    session.post(judge.url + REWARDS, json=rewards(("a", "b"), ("c", "d")))
    session.get(judge.url + "/nope")

    stats = session.get(judge.url + "/stats").json()
    assert stats == judge.stats()
    assert stats["requests"] == 23
    assert stats["accepted"] == 21
    assert stats["errors"] == 1
    assert stats["client_errors"] == 1
    assert stats["rate_limited"] == 0
    assert stats["items"] == 2
    assert stats["tokens"] == 20 * (2 + 10) + (3 + 10) + 2
    assert stats["connections_opened"] <= 2

    zeroed = session.post(judge.url + "/stats/reset").json()
    assert set(zeroed.values()) == {0}
    assert session.get(judge.url + "/health").json() == {"ok": True}


def test_random_faults_follow_the_seed(make_judge, session) -> None:
    def statuses(judge: MockJudge) -> list[int]:
        return [session.post(judge.url + CHAT, json=chat("x")).status_code for _ in range(30)]

    first = statuses(make_judge(error_rate=0.5, seed=7))
    assert first == statuses(make_judge(error_rate=0.5, seed=7))
    assert set(first) == {200, 500}

    hanging = make_judge(hang_rate=1.0, hang_s=0.01)
    assert set(statuses(hanging)) == {200}
    assert hanging.stats()["hangs"] == 30


def test_lognormal_latency_has_the_requested_mean_and_cv() -> None:
    judge = _Judge(MockJudgeSettings(latency_ms=200, latency_cv=0.5, seed=1))
    draws = [judge._draw_latency() for _ in range(20_000)]
    mean = statistics.fmean(draws)
    assert mean == pytest.approx(0.2, rel=0.03)
    assert statistics.pstdev(draws) / mean == pytest.approx(0.5, rel=0.06)


def test_constant_latency(make_judge, session) -> None:
    judge = make_judge(latency_ms=100, latency_cv=0)
    started = time.monotonic()
    session.post(judge.url + CHAT, json=chat("x"))
    assert time.monotonic() - started >= 0.1


@pytest.mark.parametrize(
    ("path", "body"),
    [(CHAT, chat("a [[mock:500]] b")), (REWARDS, rewards(("ok", "ok"), ("x", "[[mock:500]]")))],
)
def test_mock_500(make_judge, session, path, body) -> None:
    judge = make_judge()
    reply = session.post(judge.url + path, json=body)
    assert reply.status_code == 500
    assert reply.json()["error"]["type"] == "server_error"
    assert judge.stats()["errors"] == 1


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (CHAT, chat("[[mock:400]]"), "messages[0].content"),
        (REWARDS, rewards(("ok", "ok"), ("ok", "[[mock:400]]")), "items[1].response"),
    ],
)
def test_mock_400_names_the_field_and_costs_nothing(make_judge, session, path, body, field) -> None:
    judge = make_judge(rpm=60)
    reply = session.post(judge.url + path, json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert field in error["message"]
    assert session.post(judge.url + CHAT, json=chat("x")).status_code == 200  # bucket untouched


def test_mock_garbage(make_judge, session) -> None:
    judge = make_judge()
    reply = session.post(judge.url + CHAT, json=chat("[[mock:garbage]]"))
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["message"]["content"] == "I cannot decide."

    reply = session.post(judge.url + REWARDS, json=rewards(("a", "b"), ("[[mock:garbage]]", "c")))
    assert reply.status_code == 200
    assert reply.json()["scores"] == "nope"
    assert judge.stats()["items"] == 0


@pytest.mark.parametrize(
    ("path", "body"),
    [(CHAT, chat("[[mock:badjson]]")), (REWARDS, rewards(("[[mock:badjson]]", "r")))],
)
def test_mock_badjson(make_judge, session, path, body) -> None:
    judge = make_judge()
    reply = session.post(judge.url + path, json=body)
    assert reply.status_code == 200
    with pytest.raises(ValueError):
        json.loads(reply.text)


def test_mock_hang(make_judge, session) -> None:
    judge = make_judge(hang_s=0.3)
    started = time.monotonic()
    reply = session.post(judge.url + REWARDS, json=rewards(("p", "[[mock:hang]]")))
    assert reply.status_code == 200
    assert time.monotonic() - started >= 0.3
    assert judge.stats()["hangs"] == 1


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (CHAT, b"not json", "not valid JSON"),
        (CHAT, b"[1, 2]", "JSON object"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}]}, "'model'"),
        (CHAT, {"model": "m"}, "'messages'"),
        (CHAT, {"model": "m", "messages": "hi"}, "'messages'"),
        (CHAT, {"model": "m", "messages": ["hi"]}, "'messages[0]'"),
        (CHAT, {"model": "m", "messages": [{"role": "user"}]}, "'messages[0].content'"),
        (CHAT, {"model": "m", "messages": [{"content": "x"}]}, "'messages[0].role'"),
        (CHAT, {"model": "m", "messages": [{"role": "system", "content": "x"}]}, "'user'"),
        (CHAT, chat("x", max_tokens="10"), "'max_tokens'"),
        (CHAT, chat("x", max_tokens=0), "'max_tokens'"),
        (REWARDS, {"scores": []}, "'items'"),
        (REWARDS, {"items": {"prompt": "p"}}, "'items'"),
        (REWARDS, {"items": [["p", "r"]]}, "'items[0]'"),
        (
            REWARDS,
            {"items": [{"prompt": "p", "response": "r"}, {"prompt": "p"}]},
            "'items[1].response'",
        ),
        (REWARDS, {"items": [{"prompt": 1, "response": "r"}]}, "'items[0].prompt'"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(make_judge, session, path, body, field) -> None:
    judge = make_judge()
    if isinstance(body, bytes):
        reply = session.post(judge.url + path, data=body)
    else:
        reply = session.post(judge.url + path, json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert field in error["message"]
    assert judge.stats()["client_errors"] == 1


@pytest.mark.parametrize(("method", "path"), [("GET", "/nope"), ("POST", "/v1/x"), ("GET", CHAT)])
def test_unknown_endpoint_is_404(make_judge, session, method, path) -> None:
    judge = make_judge()
    reply = session.request(method, judge.url + path)
    assert reply.status_code == 404
    assert path in reply.json()["error"]["message"]


def raw(judge: MockJudge, data: bytes) -> bytes:
    """Send raw bytes, half-close, and return whatever comes back before the server hangs up."""
    host, port = judge.url.removeprefix("http://").split(":")
    chunks: list[bytes] = []
    # a server closing with junk still unread makes the kernel reset the connection: that is fine
    with (
        socket.create_connection((host, int(port)), timeout=5) as sock,
        contextlib.suppress(OSError),  # a reset, or ENOTCONN when shutting down
    ):
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_server_survives_garbage(make_judge, session) -> None:
    judge = make_judge()
    raw(judge, b"\x00\xff\xfe junk \r\n\r\n")
    raw(judge, b"x" * 100_000)
    answer = raw(judge, b"POST /v1/rewards HTTP/1.1\r\nContent-Length: banana\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400")
    answer = raw(judge, b'POST /v1/rewards HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"items"')
    assert answer.startswith(b"HTTP/1.1 400")  # the body ended early
    deep = b"[" * 100_000
    answer = raw(
        judge,
        b"POST /v1/rewards HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s"
        % (
            len(deep),
            deep,
        ),
    )
    assert answer.startswith(b"HTTP/1.1 400")
    assert session.post(judge.url + CHAT, data=b"\xff\xfe\x00").status_code == 400
    lone_surrogate = b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}'
    assert session.post(judge.url + CHAT, data=lone_surrogate).status_code == 200

    assert session.get(judge.url + "/health").json() == {"ok": True}


def test_spawn_serves_from_a_subprocess_and_stops_on_sigterm() -> None:
    with spawn(MockJudgeSettings(latency_ms=1, rpm=600.5, error_rate=0.0)) as judge:
        reply = requests.post(judge.url + CHAT, json=chat("x"))
        assert reply.headers["x-ratelimit-limit-requests"] == "600.5"
        assert judge.stats()["accepted"] == 1
    assert judge.process.returncode == 0


def test_spawn_kill_takes_the_server_down() -> None:
    judge = spawn(MockJudgeSettings(latency_ms=1))
    assert requests.get(judge.url + "/health").ok
    judge.kill()
    assert judge.process.returncode == -9
    with pytest.raises(requests.ConnectionError):
        requests.get(judge.url + "/health", timeout=2)
    judge.stop()


def test_spawn_reports_a_server_that_cannot_start() -> None:
    with pytest.raises(RuntimeError, match="exited with code"):
        spawn(MockJudgeSettings(host="256.0.0.1"))


# --- group prompts, over HTTP to a spawned judge process ----------------------------------------

GROUP_HEAD = "Rate each response.\nPrompt: What is 6 x 7?"
GROUP_RESPONSES = ["42", "It is 42.\nCheck: 6 x 7 = 42.", "41", "forty-two"]


def group_text(responses: list[str] = GROUP_RESPONSES, head: str = GROUP_HEAD) -> str:
    """A group prompt written by hand (not by qreward_queue.backends.groups), so the mock is checked
    against the wire format itself."""
    blocks = [f'<response id="{n}">\n{r}\n</response>' for n, r in enumerate(responses, 1)]
    return head + "\n" + "\n".join(blocks) + "\nAnswer with a JSON list of scores."


def ask(url: str, content: str) -> str:
    reply = requests.post(url + CHAT, json=chat(content, max_tokens=64), timeout=10)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module", params=["list", "object", "tagged"])
def group_judge(request) -> Iterator[Any]:
    settings = MockJudgeSettings(latency_ms=1, latency_cv=0, group_reply=request.param)
    with spawn(settings) as judge:
        yield judge


WANT = [rm_verdict(GROUP_HEAD, r) for r in GROUP_RESPONSES]


def test_group_prompt_scores_each_response_in_the_asked_style(group_judge) -> None:
    group_judge.reset()
    content = ask(group_judge.url, group_text())
    expected = {
        "list": f"Scores: {json.dumps(WANT)}",
        "object": "Scores: " + json.dumps({str(n): s for n, s in enumerate(WANT, 1)}),
        "tagged": "\n".join(f"[{n}] Score: {s}" for n, s in enumerate(WANT, 1)),
    }[reply_style(group_judge)]
    assert content == expected
    assert len(set(WANT)) == len(WANT)  # distinct, so a mix-up of responses would show
    stats = group_judge.stats()
    assert (stats["requests"], stats["items"]) == (1, len(GROUP_RESPONSES))
    messages_chars = len(group_text())
    assert stats["prompt_tokens"] == math.ceil(messages_chars / 4)
    assert stats["completion_tokens"] == math.ceil(len(content) / 4)


def test_split_group_reads_head_and_responses_and_refuses_bad_numbering() -> None:
    assert split_group(group_text()) == (GROUP_HEAD, GROUP_RESPONSES)
    assert split_group("Prompt: p\nResponse: r") is None
    skipped = group_text().replace('<response id="2">', '<response id="3">')
    assert split_group(skipped) is None  # then it is one sample, scored as a whole


def test_an_unknown_group_reply_style_is_refused_at_once() -> None:
    with pytest.raises(ValueError, match="group_reply must be one of list, object, tagged"):
        MockJudgeSettings(group_reply="yaml")


def test_a_text_that_is_not_a_group_keeps_the_single_verdict(group_judge) -> None:
    text = group_text().replace('<response id="1">', '<response id="0">')
    assert ask(group_judge.url, text) == f"The response was assessed. Score: {verdict(text):.2f}"


def scores_of(content: str) -> list[tuple[int, Any]]:
    """The (number, score) pairs a group reply gives, duplicates and order kept."""
    if content.startswith("["):
        pairs = re.findall(r"\[(\d+)\] Score: (\S+)", content)
        return [(int(n), s if s == "n/a" else float(s)) for n, s in pairs]
    value = json.loads(content.removeprefix("Scores: "), object_pairs_hook=list)
    return [(int(n), s) for n, s in (value if content.startswith("Scores: {") else
                                      enumerate(value, 1))]


def faulty(fault: str) -> tuple[str, list[float]]:
    """A group prompt marked with `fault`, and the scores its responses deserve."""
    head = f"{GROUP_HEAD} [[mock:group-{fault}]]"
    return group_text(head=head), [rm_verdict(head, r) for r in GROUP_RESPONSES]


def reply_style(judge) -> str:
    return judge.process.args[judge.process.args.index("--group-reply") + 1]


@pytest.mark.parametrize(
    ("fault", "spoil"),
    [
        ("few", lambda pairs: pairs[:-1]),
        ("extra", lambda pairs: [*pairs, (5, 0.5)]),
        ("dup", lambda pairs: [*pairs[:-1], (1, pairs[-1][1])]),
        ("order", lambda pairs: pairs[::-1]),
        ("nan", lambda pairs: [*pairs[:-1], (4, "n/a")]),
        ("zero", lambda pairs: [(n - 1, s) for n, s in pairs]),
    ],
)
def test_group_fault_markers_spoil_the_reply_as_named(group_judge, fault: str, spoil) -> None:
    group_judge.reset()
    text, deserved = faulty(fault)
    content = ask(group_judge.url, text)
    assert scores_of(content) == spoil(list(enumerate(deserved, 1)))
    assert group_judge.stats()["items"] == (len(deserved) if fault == "order" else 0)


def parse(content: str, judge, count: int = len(GROUP_RESPONSES)) -> list[float]:
    """The scores in a group reply, read as the judge's --group-reply style says."""
    pattern = DEFAULT_TAGGED_PATTERN if reply_style(judge) == "tagged" else None
    return parse_group_scores(content, count, pattern)


@pytest.mark.parametrize("fault", [None, *GROUP_FAULTS])
def test_the_group_parser_takes_the_good_replies_and_refuses_every_spoiled_one(
    group_judge, fault: str | None
) -> None:
    text, deserved = faulty(fault) if fault else (group_text(), WANT)
    content = ask(group_judge.url, text)
    if fault in (None, "order"):
        assert parse(content, group_judge) == deserved
    else:
        with pytest.raises(PermanentError) as caught:
            parse(content, group_judge)
        assert caught.value.detail == content


def test_group_fault_rate_is_deterministic_per_request_and_seed() -> None:
    texts = [group_text([f"answer {i}", f"other {i}"]) for i in range(60)]
    settings = MockJudgeSettings(latency_ms=1, latency_cv=0, group_fault_rate=0.5, seed=3)
    with spawn(settings) as judge:
        first = [ask(judge.url, t) for t in texts]
        again = [ask(judge.url, t) for t in texts]
        items = judge.stats()["items"]
    with spawn(dataclasses.replace(settings, seed=4)) as judge:
        reseeded = [ask(judge.url, t) for t in texts]
    parsed = 0
    for text, content in zip(texts, first, strict=True):
        deserved = [rm_verdict(GROUP_HEAD, r) for r in split_group(text)[1]]
        try:
            assert parse_group_scores(content, 2) == deserved  # clean, or only reordered
            parsed += 1
        except PermanentError:
            pass
    assert first == again and first != reseeded
    assert 15 <= 60 - parsed <= 45  # about half spoiled (5 of 6 faults refused), per text
    assert items == 2 * 2 * parsed  # two rounds, two responses: only well-formed replies count


def test_a_rendered_group_round_trips_through_the_judge_and_the_parser(group_judge) -> None:
    tricky = ["[2] Score: 1", 'I say {"1": 0}', "two\nlines", "", "<response id=\"9\">"]
    group = [{"prompt": "Which is best?", "response": r, "reference": "none"} for r in tricky]
    text = render_group(DEFAULT_GROUP_TEMPLATE, group)
    head, responses = split_group(text)
    assert responses == tricky and head.count("Which is best?") == 1
    scores = parse(ask(group_judge.url, text), group_judge, len(tricky))
    assert scores == [rm_verdict(head, r) for r in tricky]
