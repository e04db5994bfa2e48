"""Backends over real HTTP against the mock judge (and a tiny stub server for odd replies).

Every failure must be a precise ScoringError of the right class (it decides retry vs. give up);
a bad reply is never a silent 0; a bad item in a reward-model batch costs only that item.
"""

from __future__ import annotations

import inspect
import json
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from support import backend_of, free_port

from qreward_queue.backends import JudgeOptions, make_backend
from qreward_queue.backends.function import FunctionBackend
from qreward_queue.backends.injection import fence, fence_note
from qreward_queue.backends.judge import JudgeBackend
from qreward_queue.backends.reward_model import RewardModelBackend
from qreward_queue.config.model import Backend, Retry
from qreward_queue.errors import PermanentError, RateLimited, ScoringError, TransientError
from qreward_queue.testing.mock_judge import MockJudge, MockJudgeSettings, rm_verdict, verdict
from qreward_queue.worker.tasks import ChunkRunner

# --- helpers --------------------------------------------------------------------------------


def unique(prefix: str) -> str:
    """A backend name of its own per test: HTTP sessions are cached per backend name."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def judge_config(url: str, **overrides: Any) -> Backend:
    return backend_of(
        **{
            "name": unique("judge"),
            "kind": "judge",
            "url": url + "/v1",
            "model": "mock",
            "timeout_s": 5.0,
            **overrides,
        }
    )


def rm_config(url: str, **overrides: Any) -> Backend:
    return backend_of(
        **{
            "name": unique("rm"),
            "kind": "reward_model",
            "url": url + "/v1/rewards",
            "timeout_s": 5.0,
            "batch_size": 8,
            "chunk_size": 8,
            **overrides,
        }
    )


def sample(i: int, response: str | None = None, **more: Any) -> dict:
    return {"prompt": f"What is {i} + {i}?", "response": response or f"It is {2 * i}.", **more}


def raises(exc_type: type[ScoringError], fn: Callable, *args) -> ScoringError:
    with pytest.raises(exc_type) as info:
        fn(*args)
    return info.value


@pytest.fixture
def judge() -> Iterator[MockJudge]:
    with MockJudge(MockJudgeSettings(latency_ms=1, latency_cv=0, hang_s=5)) as mock:
        yield mock


class _StubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _StubServer

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.server.seen.append({"path": self.path, "headers": dict(self.headers), "body": body})
        status, headers, payload, stall_s = self.server.respond(json.loads(body))
        raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json", "Content-Length": str(len(raw)), **headers}
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(raw)
        self.wfile.flush()
        if stall_s:  # hold the connection open with the body unfinished
            self.server.stopping.wait(stall_s)
        if len(raw) != int(headers["Content-Length"]):
            self.close_connection = True


class _StubServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _StubHandler)
        self.seen: list[dict] = []
        self.stopping = threading.Event()
        self.respond: Callable[[Any], tuple[int, dict, Any, float]] = lambda body: (
            200,
            {},
            {},
            0,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def stub() -> Iterator[_StubServer]:
    """A tiny HTTP server whose reply each test sets; it records every request it gets."""
    server = _StubServer()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.daemon = True
    thread.start()
    yield server
    server.stopping.set()
    server.shutdown()
    server.server_close()
    thread.join(5)


def chat_reply(content: Any, tokens: int = 7) -> dict:
    return {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
        "usage": {"total_tokens": tokens},
    }




# --- judge ----------------------------------------------------------------------------------


def test_judge_scores_are_the_verdict_of_the_rendered_prompt(judge):
    config = judge_config(
        judge.url,
        prompt_template="Q: {prompt}\nA: {response}\nRef: {reference}\nSrc: {data_source} {extra}",
        system_prompt="You are strict.",
    )
    backend = make_backend(config)
    assert isinstance(backend, JudgeBackend)
    samples = [
        sample(1),
        sample(2, reference="4", data_source="gsm8k", extra={"k": 1}),
        sample(3, "漢字 and emoji \U0001f600 and {braces}"),
        {"prompt": "", "response": ""},
    ]
    for s in samples:
        call = backend.call([s])
        assert call.scores == [verdict(backend.render(s))]
        assert call.status_code == 200
        assert call.tokens is not None and call.tokens > 0
        assert call.details[0].endswith(f"Score: {verdict(backend.render(s)):.2f}")
    rendered = backend.render(samples[1])
    tag = fence(["It is 4."])
    assert rendered == (f"Q: What is 2 + 2?\nA: <{tag}>\nIt is 4.\n</{tag}>\n{fence_note(tag)}"
                        "\nRef: 4\nSrc: gsm8k {'k': 1}")
    assert backend.messages(samples[0])[0] == {"role": "system", "content": "You are strict."}
    assert judge.stats()["accepted"] == len(samples)


def test_judge_garbage_reply_is_an_error_quoting_the_reply_not_a_zero(judge):
    backend = make_backend(judge_config(judge.url))
    error = raises(PermanentError, backend.call, [sample(1, "[[mock:garbage]]")])
    assert "no score in the judge's reply" in str(error)
    assert error.detail == "I cannot decide."
    assert error.status_code == 200


def test_judge_bad_json_reply(judge):
    backend = make_backend(judge_config(judge.url))
    error = raises(PermanentError, backend.call, [sample(1, "[[mock:badjson]]")])
    assert "not JSON" in str(error)
    assert "chatcmpl-broken" in error.detail


def test_judge_400_is_permanent(judge):
    backend = make_backend(judge_config(judge.url))
    error = raises(PermanentError, backend.call, [sample(1, "[[mock:400]]")])
    assert error.status_code == 400
    assert "400" in str(error)
    assert "[[mock:400]]" in error.detail  # the server's own explanation is kept


def test_judge_500_is_transient(judge):
    backend = make_backend(judge_config(judge.url))
    error = raises(TransientError, backend.call, [sample(1, "[[mock:500]]")])
    assert error.status_code == 500 and "server error 500" in str(error)
    assert "server_error" in error.detail


def test_judge_429_is_rate_limited_with_retry_after():
    with MockJudge(MockJudgeSettings(rpm=60, latency_ms=1, latency_cv=0)) as judge:
        backend = make_backend(judge_config(judge.url))
        backend.call([sample(1)])  # takes the one request the 1-second bucket holds
        error = raises(RateLimited, backend.call, [sample(2)])
    assert error.status_code == 429
    assert error.retry_after_s == pytest.approx(1.0, abs=0.05)  # retry-after-ms when sent
    assert error.headers["x-ratelimit-limit-requests"] == "60"
    assert "Rate limit reached" in error.detail


def test_connection_refused_is_transient():
    backend = make_backend(judge_config(f"http://127.0.0.1:{free_port()}"))
    error = raises(TransientError, backend.call, [sample(1)])
    assert "connection to http://127.0.0.1:" in str(error)
    assert "failed: ConnectionRefusedError" in str(error)
    assert not error.timed_out


def test_timeout_is_transient_and_marked_timed_out(judge):
    backend = make_backend(judge_config(judge.url, timeout_s=0.3))
    error = raises(TransientError, backend.call, [sample(1, "[[mock:hang]]")])
    assert error.timed_out
    assert "within 0.3 s" in str(error)


def test_judge_reply_without_choices_or_text(stub):
    backend = make_backend(judge_config(stub.url))
    stub.respond = lambda body: (200, {}, {"choices": []}, 0)
    error = raises(PermanentError, backend.call, [sample(1)])
    assert "choices[0].message.content" in str(error)
    stub.respond = lambda body: (200, {}, chat_reply(None), 0)
    error = raises(PermanentError, backend.call, [sample(1)])
    assert "not text" in str(error)
    stub.respond = lambda body: (200, {}, [1, 2], 0)
    raises(PermanentError, backend.call, [sample(1)])


def test_judge_request_shape_and_custom_score_pattern(stub):
    stub.respond = lambda body: (200, {}, chat_reply("verdict=0.75 (Score: 0.1)"), 0)
    config = judge_config(stub.url, score_pattern=r"verdict=([0-9.]+)", max_tokens=9)
    call = make_backend(config).call([sample(5)])
    assert call.scores == [0.75] and call.tokens == 7
    (request,) = stub.seen
    assert request["path"] == "/v1/chat/completions"
    payload = json.loads(request["body"])
    assert payload["model"] == "mock" and payload["max_tokens"] == 9
    assert payload["messages"][-1]["role"] == "user"
    assert "Authorization" not in request["headers"]  # no api_key_env: no header


# --- API keys -------------------------------------------------------------------------------


def test_api_key_is_read_from_the_named_env_var_and_sent_as_bearer(stub, monkeypatch):
    var = f"QRQ_TEST_KEY_{uuid.uuid4().hex[:6].upper()}"
    secret = "sk-test-" + uuid.uuid4().hex
    monkeypatch.setenv(var, secret)
    stub.respond = lambda body: (200, {}, chat_reply("Score: 0.5"), 0)
    config = judge_config(stub.url, api_key_env=var)
    assert make_backend(config).call([sample(1)]).scores == [0.5]
    (request,) = stub.seen
    assert request["headers"]["Authorization"] == f"Bearer {secret}"
    assert secret.encode() not in request["body"]
    assert secret not in repr(config)  # only the variable's name is configuration

    monkeypatch.setenv(var, "sk-rotated")  # read at call time, not cached
    make_backend(config).call([sample(1)])
    assert stub.seen[-1]["headers"]["Authorization"] == "Bearer sk-rotated"


def test_rejected_key_error_does_not_echo_the_key(stub, monkeypatch):
    var = f"QRQ_TEST_KEY_{uuid.uuid4().hex[:6].upper()}"
    secret = "sk-test-" + uuid.uuid4().hex
    monkeypatch.setenv(var, secret)
    stub.respond = lambda body: (401, {}, {"error": {"message": "invalid api key"}}, 0)
    error = raises(PermanentError, make_backend(judge_config(stub.url, api_key_env=var)).call,
                   [sample(1)])
    assert error.status_code == 401
    assert secret not in str(error) and secret not in (error.detail or "")


def test_missing_api_key_env_var_names_the_variable_and_sends_nothing(stub, monkeypatch):
    var = f"QRQ_TEST_KEY_{uuid.uuid4().hex[:6].upper()}"
    monkeypatch.delenv(var, raising=False)
    config = judge_config(stub.url, api_key_env=var)
    error = raises(PermanentError, make_backend(config).call, [sample(1)])
    assert var in str(error) and "not set" in str(error) and config.name in str(error)
    assert "Bearer" not in str(error)
    assert stub.seen == []
    monkeypatch.setenv(var, "")  # set but empty is as good as missing
    raises(PermanentError, make_backend(config).call, [sample(1)])
    assert stub.seen == []


# --- reward model ---------------------------------------------------------------------------


def test_reward_model_batch_scores_equal_rm_verdict(judge):
    config = rm_config(judge.url)
    backend = make_backend(config)
    assert isinstance(backend, RewardModelBackend) and backend.samples_per_call == 8
    samples = [sample(i) for i in range(6)] + [{"prompt": "é", "response": "\U0001f600"}]
    call = backend.call(samples)
    assert call.scores == [rm_verdict(s["prompt"], s["response"]) for s in samples]
    assert call.tokens is not None and call.tokens > 0
    stats = judge.stats()
    assert (stats["requests"], stats["items"]) == (1, len(samples))


def test_reward_model_split_follows_batch_size(judge):
    backend = make_backend(rm_config(judge.url, batch_size=3))
    assert backend.split([sample(i) for i in range(7)]) == [[0, 1, 2], [3, 4, 5], [6]]


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        ({"scores": [0.1]}, "a list of 3 numbers"),
        ({"scores": [0.1, 0.2, 0.3, 0.4]}, "a list of 3 numbers"),
        ({"scores": "nope"}, "a list of 3 numbers"),
        ({"rewards": [0.1, 0.2, 0.3]}, "a list of 3 numbers"),
        ([0.1, 0.2, 0.3], "a list of 3 numbers"),
    ],
)
def test_reward_model_reply_of_the_wrong_shape_is_permanent(stub, reply, message):
    stub.respond = lambda body: (200, {}, reply, 0)
    error = raises(PermanentError, make_backend(rm_config(stub.url)).call,
                   [sample(i) for i in range(3)])
    assert message in str(error)


@pytest.mark.parametrize(
    ("reply", "bad", "message"),
    [
        ({"scores": [0.1, "0.2", 0.3]}, 1, "scores[1] is not a number"),
        ({"scores": [0.1, 0.2, True]}, 2, "scores[2] is not a number"),
        (b'{"scores": [0.1, NaN, 0.3]}', 1, "scores[1] is not a finite number"),
        (b'{"scores": [0.1, 0.2, ' + b"9" * 400 + b"]}", 2, "scores[2] is too large for a float"),
        ({"scores": [0.1, 0.2, 1e308 * 10]}, 2, "scores[2] is not a finite number"),
    ],
)
def test_a_bad_reward_model_score_fails_only_its_own_item(stub, reply, bad, message):
    stub.respond = lambda body: (200, {}, reply, 0)
    call = make_backend(rm_config(stub.url)).call([sample(i) for i in range(3)])
    assert [isinstance(s, PermanentError) for s in call.scores] == [i == bad for i in range(3)]
    assert message in str(call.scores[bad])
    assert [s for i, s in enumerate(call.scores) if i != bad] == [
        v for i, v in enumerate([0.1, 0.2, 0.3]) if i != bad
    ]


def test_reward_model_request_shape(stub):
    stub.respond = lambda body: (200, {}, {"scores": [0.5] * len(body["items"])}, 0)
    make_backend(rm_config(stub.url, model="rm-7b")).call([sample(1, reference="2", id=9)])
    payload = json.loads(stub.seen[0]["body"])
    assert payload == {"items": [{"prompt": "What is 1 + 1?", "response": "It is 2."}],
                       "model": "rm-7b"}


def test_reward_model_garbage_batch_is_permanent(judge):
    backend = make_backend(rm_config(judge.url))
    error = raises(PermanentError, backend.call, [sample(1), sample(2, "[[mock:garbage]]")])
    assert "nope" in error.detail


# --- function -------------------------------------------------------------------------------

REWARDS_MODULE = '''
import math

def length(sample):
    return len(sample["response"])

def picky(sample):
    if "boom" in sample["response"]:
        raise RuntimeError("cannot score " + sample["response"])
    if "text" in sample["response"]:
        return "high"
    if "nan" in sample["response"]:
        return math.nan
    if "bool" in sample["response"]:
        return True
    if "none" in sample["response"]:
        return None
    return 0.5

class Holder:
    @staticmethod
    def nested(sample):
        return 2

NOT_CALLABLE = 3
'''


@pytest.fixture
def rewards_module(tmp_path, monkeypatch) -> str:
    """A reward module importable by a name of its own (load_function caches per path)."""
    name = f"qrq_test_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(REWARDS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def function_config(path: str, **overrides: Any) -> Backend:
    return backend_of("function", name=unique("fn"), function=path, chunk_size=16, **overrides)


def test_function_scores_every_sample(rewards_module):
    backend = make_backend(function_config(f"{rewards_module}:length"))
    assert isinstance(backend, FunctionBackend)
    samples = [sample(1, "a"), sample(2, "abc")]
    assert backend.call(samples).scores == [1.0, 3.0]
    nested = make_backend(function_config(f"{rewards_module}:Holder.nested"))
    assert nested.call(samples).scores == [2.0, 2.0]


def test_function_failure_of_one_sample_spares_the_others(rewards_module):
    backend = make_backend(function_config(f"{rewards_module}:picky"))
    responses = ["fine", "boom!", "fine too", "text", "nan", "bool", "none", "ok"]
    scores = backend.call([sample(i, r) for i, r in enumerate(responses)]).scores
    assert [scores[i] for i in (0, 2, 7)] == [0.5, 0.5, 0.5]
    errors = {responses[i]: s for i, s in enumerate(scores) if isinstance(s, ScoringError)}
    assert set(errors) == {"boom!", "text", "nan", "bool", "none"}
    assert all(isinstance(e, PermanentError) for e in errors.values())
    assert "raised RuntimeError: cannot score boom!" in str(errors["boom!"])
    assert "returned 'high', not a finite number" in str(errors["text"])
    assert "returned nan" in str(errors["nan"])
    assert "returned True" in str(errors["bool"])
    assert "returned None" in str(errors["none"])


def test_a_huge_int_from_a_reward_function_fails_only_its_sample():
    from qreward_queue.backends.function_runner import _score_one

    error = _score_one(lambda s: 10**400, {}, {})
    assert isinstance(error, PermanentError) and str(error).endswith(", not a finite number")
    assert _score_one(lambda s: 10**20, {}, {}) == 1e20


def test_builtin_exact_match_errors_per_sample():
    backend = make_backend(function_config("qreward_queue.rewards.basic:exact_match"))
    scores = backend.call(
        [
            sample(1, "so 2", reference="2"),
            sample(2, "4"),  # no reference
            sample(3, "7", reference="6"),
        ]
    ).scores
    assert scores[0] == 1.0 and scores[2] == 0.0
    assert isinstance(scores[1], PermanentError) and "reference" in str(scores[1])


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("qrq_no_such_module_xyz:fn", "cannot import reward function 'qrq_no_such_module_xyz:fn'"),
        ("qreward_queue.rewards.basic:no_such_fn", "cannot import reward function"),
        ("qreward_queue.rewards.basic:_NUMBER", "is not callable"),
    ],
)
def test_function_bad_import_path_is_permanent(path, message):
    backend = make_backend(function_config(path))
    error = raises(PermanentError, backend.call, [sample(1)])
    assert message in str(error)


def test_function_not_callable_attribute(rewards_module):
    backend = make_backend(function_config(f"{rewards_module}:NOT_CALLABLE"))
    assert "is not callable" in str(raises(PermanentError, backend.call, [sample(1)]))


# --- ChunkRunner: a bad item in a batch costs only that item --------------------------------


def run_chunk(config: Backend, samples: list[dict]) -> list:
    """Run one chunk without limiter or breaker, first attempt; its outcomes in order."""
    result = ChunkRunner(config, None, None, 1).run(samples)
    assert len(result.outcomes) == len(samples)
    return result.outcomes


@pytest.mark.parametrize("trigger", ["[[mock:400]]", "[[mock:garbage]]", "[[mock:badjson]]"])
def test_chunk_runner_isolates_the_bad_item_of_a_reward_model_batch(judge, trigger):
    samples = [sample(i) for i in range(8)]
    samples[5] = sample(5, f"bad {trigger}")
    outcomes = run_chunk(rm_config(judge.url, batch_size=8), samples)
    for i, outcome in enumerate(outcomes):
        if i == 5:
            assert outcome.status == "error" and outcome.error
        else:
            want = rm_verdict(samples[i]["prompt"], samples[i]["response"])
            assert (outcome.status, outcome.score) == ("ok", want), (i, outcome)
    assert outcomes[0].backend == outcomes[5].backend
    assert judge.stats()["requests"] <= 1 + 2 * 3  # halving: log2(8) levels, two calls each


def test_chunk_runner_scores_a_judge_chunk_call_by_call(judge):
    config = judge_config(judge.url)
    samples = [sample(1), sample(2, "[[mock:garbage]]"), sample(3)]
    outcomes = run_chunk(config, samples)
    backend = JudgeBackend(config)
    assert [o.status for o in outcomes] == ["ok", "error", "ok"]
    assert outcomes[0].score == verdict(backend.render(samples[0]))
    assert outcomes[2].score == verdict(backend.render(samples[2]))
    assert outcomes[1].detail == "I cannot decide."
    assert all(o.attempts >= 1 and o.latency_ms >= 0 for o in outcomes)


def test_chunk_runner_function_errors_are_per_sample(rewards_module):
    config = function_config(f"{rewards_module}:picky")
    outcomes = run_chunk(config, [sample(1, "ok"), sample(2, "boom"), sample(3, "ok")])
    assert [o.status for o in outcomes] == ["ok", "error", "ok"]
    assert "RuntimeError" in outcomes[1].error


def test_chunk_runner_waits_out_retry_after_without_a_limiter():
    with MockJudge(MockJudgeSettings(rpm=60, latency_ms=1, latency_cv=0)) as judge:
        config = judge_config(judge.url, retry=Retry(attempts=3))  # retries after Retry-After
        make_backend(config).call([sample(0)])  # empties the 1-request bucket
        (outcome,) = run_chunk(config, [sample(1)])
        stats = judge.stats()
    assert outcome.status == "ok"
    assert stats["rate_limited"] <= 2


@pytest.mark.parametrize("on_loop", [True, False])
def test_a_fault_is_tried_again_in_the_chunks_run_through_the_limiter(judge, monkeypatch,
                                                                       on_loop):
    """A 500 costs its own call one more try in the same run (under the limiter like any
    call), not a task retry: every sample ok, one request more than samples."""
    import fakeredis

    from qreward_queue.flow.limiter import Limiter

    config = judge_config(judge.url, retry=Retry(attempts=3, backoff_base_s=0.01))
    if not on_loop:  # the call pool's threads (a kind that is not awaitable)
        monkeypatch.setattr(type(make_backend(config)), "awaitable", False)
    limiter = Limiter(fakeredis.FakeRedis(), config.name, rpm=60_000, max_concurrent=64)
    granted = []
    for verb in ("reserve", "reserve_async"):
        monkeypatch.setattr(limiter, verb, spy(getattr(limiter, verb), granted))
    samples = [sample(i) for i in range(6)]
    samples[2] = sample(2, "It is 4. [[mock:500-once]]")
    result = ChunkRunner(config, limiter, None, 1).run(samples)
    assert sum(granted) == 7  # six calls and the retry, each with its grant
    assert [o.status for o in result.outcomes] == ["ok"] * 6 and not result.retryable
    assert [o.attempts for o in result.outcomes] == [1, 1, 2, 1, 1, 1]
    stats = judge.stats()
    assert (stats["requests"], stats["errors"]) == (7, 1)
    limiter.flush()  # finishes of good calls on the loop are sent together, a moment later
    assert limiter.status()["leases_in_use"] == 0  # every grant went back, the retry's too


def test_a_call_that_meets_a_fault_then_a_429_counts_both_tries(stub):
    """A call on the loop that goes on on a thread (a 429's wait) keeps the tries its fault
    spent on the loop: its outcome reports every attempt."""
    replies = iter([(500, {}, {"error": {"message": "boom"}}, 0),
                    (429, {"Retry-After": "0"}, {"error": {"message": "slow down"}}, 0)])
    good = (200, {}, chat_reply("Score: 0.5"), 0)
    stub.respond = lambda body: next(replies, good) if "marked" in json.dumps(body) else good
    config = judge_config(stub.url, retry=Retry(attempts=4, backoff_base_s=0.01))
    result = ChunkRunner(config, None, None, 1).run([sample(1), sample(2, "marked")])
    assert [o.attempts for o in result.outcomes] == [1, 3]
    assert [o.status for o in result.outcomes] == ["ok", "ok"] and len(stub.seen) == 4


def spy(reserve: Callable, granted: list[int]) -> Callable:
    """`reserve` or `reserve_async`, adding how many grants each booking gave to `granted`."""
    if inspect.iscoroutinefunction(reserve):
        async def booked_async(count: int, *args: Any) -> list:
            grants = await reserve(count, *args)
            granted.append(len(grants))
            return grants
        return booked_async

    def booked(count: int, *args: Any) -> list:
        grants = reserve(count, *args)
        granted.append(len(grants))
        return grants
    return booked


def test_a_call_failing_every_try_spends_its_attempts_in_the_run_then_is_left(judge):
    config = judge_config(judge.url, retry=Retry(attempts=3, backoff_base_s=0.01))
    samples = [sample(1), sample(2, "[[mock:500]]")]
    result = ChunkRunner(config, None, None, 1).run(samples)
    assert result.outcomes[0].status == "ok"
    failed = result.outcomes[1]
    assert (failed.status, failed.attempts) == ("error", 3) and result.retryable == {1}
    assert judge.stats()["errors"] == 3


# --- HTTP edge cases: every failure is a ScoringError, never a raw exception ----------------


def test_429_without_retry_after_is_rate_limited(stub):
    stub.respond = lambda body: (429, {}, {"error": {"message": "slow down"}}, 0)
    error = raises(RateLimited, make_backend(judge_config(stub.url)).call, [sample(1)])
    assert error.retry_after_s is None


def test_429_with_malformed_retry_after_is_rate_limited(stub):
    stub.respond = lambda body: (429, {"Retry-After": "soon"}, {}, 0)
    error = raises(RateLimited, make_backend(judge_config(stub.url)).call, [sample(1)])
    assert error.retry_after_s is None


def test_429_with_http_date_retry_after(stub):
    stub.respond = lambda body: (429, {"Retry-After": "Thu, 01 Jan 1970 00:00:10 GMT"}, {}, 0)
    error = raises(RateLimited, make_backend(judge_config(stub.url)).call, [sample(1)])
    assert error.retry_after_s == 0.0  # a date in the past: go now


def test_truncated_reply_body_is_transient(stub):
    stub.respond = lambda body: (200, {"Content-Length": "100"}, b'{"choi', 0)
    raises(TransientError, make_backend(judge_config(stub.url)).call, [sample(1)])


def test_stalled_reply_body_is_a_transient_timeout(stub):
    stub.respond = lambda body: (200, {"Content-Length": "100"}, b'{"choi', 5)
    error = raises(TransientError, make_backend(judge_config(stub.url, timeout_s=0.3)).call,
                   [sample(1)])
    assert error.timed_out


def test_backend_config_is_hashable_for_the_client_cache(judge):
    config = judge_config(judge.url)
    assert hash(config) == hash(replace(config))


@pytest.mark.parametrize(
    ("policy", "score_range", "content", "expected"),
    [
        ("unique", None, "Score: 0.2 and later Score: 0.20", 0.2),
        ("unique", None, "Score: 0.2 then Score: 0.9", "2 different scores"),
        ("first", None, "Score: 0.2 then Score: 0.9", 0.2),
        ("last", None, "Score: 0.2 then Score: 0.9", 0.9),
        ("unique", (0.0, 10.0), "Score: 7", 7.0),
        ("unique", (0.0, 10.0), "Score: 10.5", "outside score_range [0, 10]"),
        ("unique", None, "Score: 1e309", "not a finite number"),
        ("unique", None, "Score: 2.5e-1", 0.25),
        ("unique", None, "Score: " + "9" * 400, "not a finite number"),
        ("unique", None, "no verdict", "no score"),
    ],
)
def test_judge_score_policies(policy, score_range, content, expected):
    judge = make_backend(judge_config("http://127.0.0.1:1", score_match=policy,
                                      score_range=score_range))
    score = judge.parse_score(content)
    if isinstance(expected, float):
        assert score == expected
    else:
        assert isinstance(score, PermanentError) and expected in str(score), score
        assert score.detail == content


def test_default_judge_file_bounds_scores_to_the_template_scale(tmp_path):
    from qreward_queue.config.loader import load_backend

    path = tmp_path / "j.toml"
    path.write_text('[backend]\nkind = "judge"\nurl = "http://h/v1"\nmodel = "m"\n')
    assert load_backend(path).options.score_range == (0.0, 1.0)
    path.write_text(path.read_text() + 'prompt_template = "Rate 1-10: {response}"\n')
    assert load_backend(path).options.score_range is None


# --- ChunkRunner: every slot a chunk takes goes back, whatever raises -----------------------

@pytest.mark.parametrize("on_loop", [True, False])
def test_slots_go_back_when_booking_a_chunks_grants_raises(judge, monkeypatch, on_loop):
    import fakeredis

    from qreward_queue.flow.limiter import Limiter
    from qreward_queue.worker import call_loop, call_pool

    config = judge_config(judge.url)
    client = make_backend(config)
    if not on_loop:  # the call pool's threads (a kind that is not awaitable)
        monkeypatch.setattr(type(client), "awaitable", False)

    def broken_estimate(samples: list[dict]) -> int:
        raise TypeError("estimate of a malformed sample")

    monkeypatch.setattr(client, "estimate_tokens", broken_estimate)
    limiter = Limiter(fakeredis.FakeRedis(), config.name, rpm=60_000, max_concurrent=64)
    for _ in range(3):  # more times than a self-sizing pool has slots to lose
        with pytest.raises(TypeError, match="estimate of a malformed sample"):
            ChunkRunner(config, limiter, None, 1).run([sample(i) for i in range(8)])
    if on_loop:
        slots = call_loop.call_loop().slots(config)
        assert slots._used == 0
    else:
        assert call_pool.call_pool(config)._used == 0
    monkeypatch.undo()
    result = ChunkRunner(config, limiter, None, 1).run([sample(i) for i in range(8)])
    assert [o.status for o in result.outcomes] == ["ok"] * 8


def test_a_slot_woken_for_a_cancelled_caller_goes_to_the_next_waiter():
    import asyncio

    from qreward_queue.config.model import Pool
    from qreward_queue.worker.call_loop import Slots
    from qreward_queue.worker.call_pool import CallSizing

    async def scenario() -> int:
        config = Backend("j", "judge", pool=Pool(calls=1, sized=False),
                         options=JudgeOptions(url="http://h/v1", model="m"))
        slots = Slots(CallSizing(config))
        assert await slots.take(1) == 1  # the one slot is held
        cancelled = asyncio.ensure_future(slots.take(1))
        waiting = asyncio.ensure_future(slots.take(1))
        await asyncio.sleep(0)  # both wait for the slot
        slots.give()  # the first waiter is woken for it...
        cancelled.cancel()  # ...and its caller gives up before it could take it
        return await asyncio.wait_for(waiting, 5)

    assert asyncio.run(scenario()) == 1
