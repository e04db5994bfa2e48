"""An RL framework's own judge class pointed at `qrq gateway`'s base URL: verifiers 0.4.0's
`vf.Judge` (prime-rl's environments), as a taskset subclasses it, text and structured output.

Run by .ci/frameworks.sh in its own virtualenv (verifiers pins openai<3); skipped where
verifiers is not installed. Real Redis, a real `qrq worker`, the mock judge over real HTTP with
a rate limit that verifiers, which never retries (its clients have max_retries=0), cannot meet
on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re

import pytest
import redis
from conftest import REDIS_DB, REDIS_HOST, REDIS_PORT
from pydantic import BaseModel
from support import judge_backend, start_gateway, start_workers, wait_for, write_config

from qreward_queue.config.loader import load_config
from qreward_queue.config.model import Config
from qreward_queue.ops.job_spend import job_rows
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn, verdict

vf = pytest.importorskip("verifiers.v1", reason="framework packages: run bash .ci/frameworks.sh")

JUDGE_RPM = 600  # 10 a second: a burst of 40 calls straight at it gets 429s
QRQ_RPM = 540  # qrq's limit for it, a little under the judge's (as one sets it for a provider)
BURST = 40
KEY, KEY_VAR, KEYS_ENV = "key-rl-run-0123456789", "QRQ_TEST_JUDGE_KEY", "QRQ_TEST_GATEWAY_KEYS"
PROMPT = "Question: {question}\nResponse: {response}\nGrade the response from 0 to 1."


class ScoreJudge(vf.Judge[float]):
    """A taskset's judge as verifiers' docs write one: a prompt template and a parse."""

    prompt = PROMPT

    def parse(self, response: vf.JudgeResponse[float]) -> float:
        found = re.search(r"Score: ([0-9.]+)", response.text)
        if found is None:
            raise ValueError(f"no score in the judge's reply: {response.text!r}")
        return float(found.group(1))


class Grade(BaseModel):
    score: float


class StructuredJudge(vf.Judge[Grade]):
    """The same judge through OpenAI structured outputs (`response_format` json_schema)."""

    prompt = PROMPT
    schema = Grade


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The rate-limited mock judge, a worker for it and a gateway with one key."""
    client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=REDIS_DB)
    client.flushdb()
    path = tmp_path_factory.mktemp("frameworks")
    with contextlib.ExitStack() as stack:
        judge = stack.enter_context(spawn(MockJudgeSettings(rpm=JUDGE_RPM, latency_ms=20)))
        config = write_config(path, {"judge": judge_backend(judge.url, rpm=QRQ_RPM)},
                              f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}", route="judge",
                              deadline_s=60)
        with config.open("a") as fh:
            fh.write(f'[gateway]\nkeys_env = "{KEYS_ENV}"\n')
        for worker in start_workers(config, [("judge", "judge@frameworks")]):
            stack.callback(worker.kill)
        keys = [{"key": KEY, "job": "rl-run", "priorities": ["train", "val"]}]
        url, _ = start_gateway(stack, config, env={KEYS_ENV: json.dumps(keys)})
        yield {"url": url, "judge": judge, "redis": client, "config": load_config(config)}
        client.close()


@pytest.fixture(autouse=True)
def gateway_key(monkeypatch):
    monkeypatch.setenv(KEY_VAR, KEY)  # verifiers reads the key from the variable it is told


def config(base_url: str, **fields) -> vf.JudgeConfig:
    return vf.JudgeConfig(base_url=base_url, api_key_var=KEY_VAR, model="judge", **fields)


def cases(tag: str, n: int) -> list[dict[str, str]]:
    return [{"question": f"{tag} {i}: what is 2+2?", "response": f"It is {i % 5}."}
            for i in range(n)]


def asked(case: dict[str, str]) -> str:
    """The text the judge is sent (the one user message verifiers builds)."""
    return PROMPT.replace("{question}", case["question"]).replace("{response}", case["response"])


def spent_calls(store: redis.Redis, config: Config, job: str) -> int:
    """The calls the workers booked for `job` (0 before their first flush)."""
    return next((r["total"]["calls"] for r in job_rows(store, config) if r["job"] == job), 0)


async def evaluate_all(judge: vf.Judge, samples: list[dict[str, str]]) -> list:
    return await asyncio.gather(*(judge.evaluate(**case) for case in samples),
                                return_exceptions=True)


def test_verifiers_judge_through_the_gateway_scores_a_burst_within_the_limit(stack):
    judge, n = stack["judge"], BURST
    judge.reset()
    samples = cases("q", n)
    verdicts = asyncio.run(evaluate_all(
        ScoreJudge(config(stack["url"] + "/v1", headers={"X-Qrq-Priority": "val"})), samples))
    assert not [v for v in verdicts if isinstance(v, Exception)], verdicts
    # every reward verifiers read is the mock judge's verdict on what verifiers asked
    assert [v.parsed for v in verdicts] == [round(verdict(asked(c)), 2) for c in samples]
    assert all(v.usage.prompt_tokens > 0 and v.usage.completion_tokens > 0 for v in verdicts)
    # ...and came through qrq: the judge saw each call once, within its limit, and the
    # gateway counted the job's spend
    stats = judge.stats()
    assert stats["accepted"] == n and stats["rate_limited"] == 0, stats
    wait_for(lambda: spent_calls(stack["redis"], stack["config"], "rl-run") == n, 10,
             "the job's spend")


def test_verifiers_structured_output_judge_gets_the_parsed_grade(stack):
    judge = stack["judge"]
    judge.reset()
    samples = cases("s", 6)
    verdicts = asyncio.run(evaluate_all(StructuredJudge(config(stack["url"] + "/v1")), samples))
    assert not [v for v in verdicts if isinstance(v, Exception)], verdicts
    assert [v.parsed for v in verdicts] == [Grade(score=round(verdict(asked(c)), 2))
                                            for c in samples]
    assert judge.stats()["accepted"] == len(samples)


def test_a_refused_sample_is_an_error_verifiers_raises_not_a_zero(stack):
    """A judge failure reaches verifiers as an exception (its rule: never score the model 0
    for the judge's fault); the gateway's 502 says it is not worth retrying."""
    import openai

    judge = vf.Judge[str](config(stack["url"] + "/v1"))
    with pytest.raises(openai.APIStatusError) as failed:
        asyncio.run(judge.complete("grade this [[mock:500]]"))
    assert failed.value.status_code == 502 and failed.value.code == "judge_failed"


def test_the_same_burst_straight_at_the_judge_fails_in_verifiers(stack):
    """What the gateway spared the judge class (last in the module: it drains the judge's
    bucket): verifiers does not retry, so each 429 is a failed rollout."""
    judge = stack["judge"]
    judge.reset()
    direct = asyncio.run(evaluate_all(ScoreJudge(config(judge.url + "/v1")), cases("d", BURST)))
    refused = [r for r in direct if isinstance(r, Exception)]
    assert refused and all("429" in str(r) for r in refused), direct[:3]
    assert judge.stats()["rate_limited"] == len(refused)
