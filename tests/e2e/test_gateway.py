"""`qrq gateway` as OpenRLHF (0.11.2 SingleTurnAgentExecutor) and slime (624b824 remote_rm)
call it: one sample per POST, many at once, over real HTTP, onto real Redis and a real worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import pytest
import redis
import requests
from conftest import REDIS_DB, REDIS_HOST, REDIS_PORT
from support import start_gateway
from trainer_stack import FALLBACK, judge_score, start_stack

from qreward_queue.integrations.coerce import make_sample

OK, FAIL_500, HANG = "The answer is 4.", "Sorry [[mock:500]]", "Thinking [[mock:hang]]"
DEADLINE_S = 4.0


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """One stack and gateway for the module (the last test kills its workers)."""
    client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=REDIS_DB)
    client.flushdb()
    client.close()
    path = tmp_path_factory.mktemp("gateway")
    with contextlib.ExitStack() as stack:
        app, _, workers = start_stack(stack, path,
                                      f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}")
        url, _ = start_gateway(stack, path / "qrq.toml", "--host", "127.0.0.1",
                               "--deadline-s", str(DEADLINE_S))
        yield app, url, workers


async def post_all(url: str, bodies: list[dict]) -> list[tuple[int, object]]:
    """OpenRLHF's client: aiohttp, a 180 s total timeout, one request per sample, concurrent."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
        async def one(body):
            async with session.post(url, json=body) as resp:
                return resp.status, await resp.json(content_type=None)
        return await asyncio.gather(*map(one, bodies))


def test_openrlhf_requests_are_micro_batched_and_always_get_numbers(gateway):
    app, url, _ = gateway
    responses = [OK, FAIL_500, "It is 5.", HANG] * 8
    prompts = [f"<|im_start|>user\nG{i}: 2+2?<|im_end|>\n<|im_start|>assistant\n"
               for i in range(32)]
    bodies = [{"query": [p + r + "<|im_end|>"], "prompts": [p], "labels": ["4"]}
              for p, r in zip(prompts, responses, strict=True)]
    started = time.monotonic()
    replies = asyncio.run(post_all(url + "/get_reward", bodies))
    # deadline promise: the gateway answers by its own deadline (+ grace), hung samples too
    assert time.monotonic() - started < DEADLINE_S + 10
    for prompt, response, (status, body) in zip(prompts, responses, replies, strict=True):
        assert status == 200
        failed = response in (FAIL_500, HANG)
        want = FALLBACK if failed else judge_score(app, make_sample(prompt, response, "4"))
        assert body == {"rewards": [want], "scores": [want],
                        "extra_logs": {"qrq_ok": [0.0 if failed else 1.0]}}
    assert requests.get(url + "/health", timeout=5).json()["batches_sent"] <= 4


def test_slime_remote_rm_gets_the_reward_as_the_json_body(gateway):
    app, url, _ = gateway
    bodies = [{"prompt": f"S{i}: 2+2?", "response": r, "label": "4"}
              for i, r in enumerate([OK, "It is 5.", FAIL_500])]
    replies = asyncio.run(post_all(url + "/slime", bodies))
    assert replies == [(200, judge_score(app, make_sample(b["prompt"], b["response"], "4")))
                       for b in bodies[:2]] + [(200, FALLBACK)]


def test_bad_requests_get_a_400_naming_the_field(gateway):
    _, url, _ = gateway
    cases = [("/get_reward", b"not json", "not JSON"),
             ("/get_reward", b'{"query": "x", "prompts": ["p"]}', "'query'"),
             ("/get_reward", b'{"query": ["a", "b"], "prompts": ["p"]}', "same length"),
             ("/slime", b'{"prompt": "p"}', "'response'"),
             ("/slime", b"[1]", "JSON object")]
    for path, body, needle in cases:
        reply = requests.post(url + path, data=body, timeout=10)
        assert reply.status_code == 400 and needle in reply.text, (path, reply.text)


def test_with_no_worker_left_the_gateway_still_answers_by_its_deadline(gateway):
    # last in the module: it kills the module's workers
    _, url, workers = gateway
    for worker in workers:
        worker.kill()
    body = {"query": ["p" + OK], "prompts": ["p"], "labels": ["4"]}
    started = time.monotonic()
    [(status, reply)] = asyncio.run(post_all(url + "/get_reward", [body]))
    # deadline promise: with no worker the gateway still answers, by its deadline
    assert DEADLINE_S - 0.5 <= time.monotonic() - started < DEADLINE_S + 6
    assert status == 200
    assert reply == {"rewards": [FALLBACK], "scores": [FALLBACK], "extra_logs": {"qrq_ok": [0.0]}}
