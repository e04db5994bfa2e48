"""`qrq gateway`'s OpenAI-compatible front door, called by the real `openai` client (sync and
async, from 4 processes at once) and by LiteLLM, over real HTTP onto real Redis and real
workers, against a rate-limited mock judge and a judge that formats its replies its own way.
"""

from __future__ import annotations

import contextlib
import json
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM: no fetch at import
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
import redis
import requests
from conftest import REDIS_DB, REDIS_HOST, REDIS_PORT
from support import (
    judge_backend,
    start_gateway,
    start_workers,
    wait_for,
    write_config,
)

from qreward_queue.config.loader import load_config
from qreward_queue.ops.job_spend import job_rows
from qreward_queue.ops.status import render_status
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn, verdict

JUDGE_RPM = 1200  # 20 requests a second, for the judge and for qrq's limiter alike
KEYS = [
    {"key": "key-team-a-0123456789", "job": "team-a", "priorities": ["train", "bulk"]},
    {"key": "key-eval-0123456789", "job": "eval", "priorities": ["val", "train"]},
    {"key": "key-tiny-0123456789", "job": "tiny"},
]
TEAM_A, EVAL, TINY = (k["key"] for k in KEYS)
KEYS_ENV = "QRQ_TEST_GATEWAY_KEYS"


class OwnStyleJudge(ThreadingHTTPServer):
    """A judge that writes its replies as no JSON library would by default (indented, keys in
    its own order, non-ASCII as is), and keeps every body it sent."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        super().__init__(("127.0.0.1", 0), _OwnStyle)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _OwnStyle(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = request["messages"][-1]["content"]
        body = ('{\n  "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},'
                f'\n  "model": {json.dumps(request["model"])},\n  "object": "chat.completion",'
                f'\n  "id": "own-{len(self.server.sent)}", "created": 1,'
                '\n  "choices": [{"index": 0, "finish_reason": "stop", '
                '"message": {"role": "assistant", "content": '
                f'"{text} -> très bien ✓"}}}}]\n}}\n').encode()
        self.server.sent.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """The mock judge (rpm-limited), the own-style judge, a worker for each, a backend nobody
    serves, and one gateway with three keys."""
    client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=REDIS_DB)
    client.flushdb()
    path = tmp_path_factory.mktemp("openai-gateway")
    with contextlib.ExitStack() as stack:
        judge = stack.enter_context(spawn(MockJudgeSettings(rpm=JUDGE_RPM, latency_ms=20,
                                                            latency_cv=0.3)))
        own = OwnStyleJudge()
        threading.Thread(target=own.serve_forever, daemon=True).start()
        stack.callback(own.shutdown)
        config = write_config(path, {
            "judge": judge_backend(judge.url, rpm=JUDGE_RPM, concurrency=8),
            "own": judge_backend(own.url, model="own-model-7b"),
            "lonely": judge_backend(judge.url),
            "claude": judge_backend(judge.url, dialect="anthropic"),
        }, f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}", route="judge", deadline_s=30)
        with config.open("a") as fh:
            fh.write('[routes.cached]\nbackends = ["judge"]\ncache = true\n'
                     f'[gateway]\nkeys_env = "{KEYS_ENV}"\n'
                     "[gateway.budget.tiny]\ntokens_total = 40\n")
        for worker in start_workers(config, [("judge", "judge@gw"), ("own", "own@gw")]):
            stack.callback(worker.kill)
        url, log = start_gateway(stack, config, env={KEYS_ENV: json.dumps(KEYS)})
        yield {"url": url, "judge": judge, "own": own, "log": log, "redis": client,
               "config": config}
        client.close()


def client(gateway, key=TEAM_A, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway["url"] + "/v1", api_key=key, max_retries=0, **kwargs)


def mock_reply(raw: bytes, prompt: str, text: bool = False) -> bytes:
    """The bytes the mock judge sends for a one-message chat request (a text completion's with
    `text`), its id and time as given."""
    got = json.loads(raw)
    content = f"The response was assessed. Score: {verdict(prompt):.2f}"
    tokens_in, tokens_out = -(-len(prompt) // 4), -(-len(content) // 4)
    choice = {"text": content, "index": 0, "logprobs": None, "finish_reason": "stop"} if text \
        else {"index": 0, "message": {"role": "assistant", "content": content},
              "finish_reason": "stop"}
    return json.dumps({
        "id": got["id"], "object": "text_completion" if text else "chat.completion",
        "created": got["created"], "model": "mock", "choices": [choice],
        "usage": {"prompt_tokens": tokens_in, "completion_tokens": tokens_out,
                  "total_tokens": tokens_in + tokens_out},
    }).encode()


CLIENT_SCRIPT = textwrap.dedent("""
    import asyncio, json, sys, time
    from concurrent.futures import ThreadPoolExecutor
    import openai

    url, key, mode, n, tag = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    prompts = [f"{tag}: is 2+2 = 4? case {i}" for i in range(n)]

    def record(prompt, reply):
        return {"prompt": prompt, "status": reply.status_code, "raw": reply.content.decode(),
                "done": time.time()}

    if mode == "sync":
        chat = openai.OpenAI(base_url=url, api_key=key).chat.completions
        def one(prompt):
            return record(prompt, chat.with_raw_response.create(
                model="qrq/judge", messages=[{"role": "user", "content": prompt}]))
        with ThreadPoolExecutor(16) as pool:
            out = list(pool.map(one, prompts))
    else:
        async def main():
            chat = openai.AsyncOpenAI(base_url=url, api_key=key).chat.completions
            async def one(prompt):
                return record(prompt, await chat.with_raw_response.create(
                    model="judge", messages=[{"role": "user", "content": prompt}]))
            return await asyncio.gather(*map(one, prompts))
        out = asyncio.run(main())
    print(json.dumps(out))
""")


def test_openai_clients_in_4_processes_share_the_judges_limit(gateway, tmp_path):
    judge = gateway["judge"]
    judge.reset()
    script = tmp_path / "client.py"
    script.write_text(CLIENT_SCRIPT)
    per_process = 40
    started = time.time()
    procs = [subprocess.Popen([sys.executable, str(script), gateway["url"] + "/v1", TEAM_A, mode,
                               str(per_process), f"p{i}"], stdout=subprocess.PIPE, text=True)
             for i, mode in enumerate(["sync", "async", "sync", "async"])]
    # the judge's 429s by the end of the first second of load (both buckets start full)
    wait_for(lambda: judge.stats()["requests"], 60, "the first request at the judge")
    time.sleep(1.0)
    first_second_429s = judge.stats()["rate_limited"]
    results = [r for proc in procs for r in json.loads(proc.communicate(timeout=120)[0])]
    assert all(proc.returncode == 0 for proc in procs)
    stats = judge.stats()
    assert len(results) == 4 * per_process and all(r["status"] == 200 for r in results)
    # every reply is the judge's own, byte for byte: its model name, its usage
    for r in results:
        assert r["raw"].encode() == mock_reply(r["raw"].encode(), r["prompt"]), r
    # the limit held: at most one 429 from the judge after the first second (the two buckets'
    # refills drift by a few ms: 1 of 6 full runs saw one), and the calls took as long as 20 a
    # second allows (less the one-second burst both buckets start with)
    assert first_second_429s <= 2 and stats["rate_limited"] - first_second_429s <= 1, stats
    assert stats["accepted"] == 4 * per_process
    elapsed = max(r["done"] for r in results) - started
    assert elapsed >= (4 * per_process - JUDGE_RPM / 60) / (JUDGE_RPM / 60) * 0.9
    # spend is counted per job, by the workers: every call made (a 429 answered is one too,
    # as in the backend's spend)
    wait_for(lambda: jobs_of(gateway)["team-a"]["total"]["calls"]
             >= stats["accepted"] + first_second_429s, 5, "team-a's spend")
    rows = jobs_of(gateway)
    assert rows["team-a"]["total"]["calls"] == stats["requests"]
    assert rows["team-a"]["total"]["tokens_in"] > 0
    status = render_status(load_config(gateway["config"]))  # what `qrq status` prints
    assert f"job team-a: spent {stats['requests']:,} calls" in status, status


def jobs_of(gateway) -> dict[str, dict]:
    """What `qrq status` says of each job, by name."""
    return {r["job"]: r for r in job_rows(gateway["redis"], load_config(gateway["config"]))}


def test_replies_are_the_judges_bytes_even_in_its_own_style(gateway):
    own = gateway["own"]
    reply = client(gateway).chat.completions.with_raw_response.create(
        model="qrq/own", messages=[{"role": "user", "content": "Ünïcode?"}], temperature=0.3)
    assert reply.status_code == 200 and reply.content == own.sent[-1]
    parsed = reply.parse()
    assert parsed.model == "own-model-7b" and parsed.usage.total_tokens == 10
    assert parsed.choices[0].message.content == "Ünïcode? -> très bien ✓"


def test_async_client_and_litellm_get_the_same_reply_shape(gateway):
    import asyncio

    import litellm

    async def ask() -> str:
        chat = openai.AsyncOpenAI(base_url=gateway["url"] + "/v1", api_key=TEAM_A)
        reply = await chat.chat.completions.create(
            model="judge", messages=[{"role": "user", "content": "async?"}])
        return reply.choices[0].message.content

    assert asyncio.run(ask()).endswith(f"Score: {verdict('async?'):.2f}")
    reply = litellm.completion(model="openai/qrq/judge", api_base=gateway["url"] + "/v1",
                               api_key=TEAM_A, messages=[{"role": "user", "content": "lite?"}])
    assert reply.choices[0].message.content.endswith(f"Score: {verdict('lite?'):.2f}")
    assert reply.usage.total_tokens > 0


def test_errors_come_in_openais_shape_and_status(gateway):
    chat = client(gateway).chat.completions
    ask = {"messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(openai.BadRequestError, match="stream") as bad:
        chat.create(model="judge", stream=True, **ask)
    assert bad.value.body["param"] == "stream"
    with pytest.raises(openai.AuthenticationError):
        client(gateway, key="not-a-key-at-all").chat.completions.create(model="judge", **ask)
    with pytest.raises(openai.NotFoundError, match="unknown route"):
        chat.create(model="qrq/nope", **ask)
    with pytest.raises(openai.PermissionDeniedError, match="not allowed for job 'team-a'"):
        chat.create(model="judge", extra_headers={"X-Qrq-Priority": "val"}, **ask)
    with pytest.raises(openai.BadRequestError, match="X-Qrq-Deadline-S"):
        chat.create(model="judge", extra_headers={"X-Qrq-Deadline-S": "soon"}, **ask)
    # eval may use val
    ok = client(gateway, key=EVAL).chat.completions.create(
        model="judge", extra_headers={"X-Qrq-Priority": "val"}, **ask)
    assert ok.model == "mock"
    # no worker consumes the route's queue: 503, at once
    with pytest.raises(openai.InternalServerError) as unserved:
        chat.create(model="lonely", **ask)
    assert unserved.value.status_code == 503 and "no live worker" in str(unserved.value)
    # the judge refused the request itself (a 400 of its own): a 400 quoting it
    with pytest.raises(openai.BadRequestError, match="refused"):
        chat.create(model="judge", messages=[{"role": "user", "content": "[[mock:400]]"}])
    # any other /v1 call: a 404 in OpenAI's shape saying what is served
    with pytest.raises(openai.NotFoundError, match=r"POST /v1/embeddings is not served") as old:
        client(gateway).embeddings.create(model="judge", input="x")
    assert old.value.code == "unknown_url"
    models = [m.id for m in client(gateway).models.list()]
    assert "judge" in models and "cached" in models


def test_text_completions_go_the_same_way_to_the_judges_completions_endpoint(gateway):
    judge = gateway["judge"]
    judge.reset()
    completions = client(gateway).completions
    reply = completions.with_raw_response.create(model="qrq/judge", prompt="Rate: 2+2=4",
                                                  max_tokens=20, temperature=0.2)
    assert reply.status_code == 200 and reply.headers["x-qrq-backend"] == "judge"
    assert reply.content == mock_reply(reply.content, "Rate: 2+2=4", text=True)
    parsed = reply.parse()
    assert parsed.object == "text_completion" and parsed.usage.total_tokens > 0
    one = completions.create(model="judge", prompt=["a list of one"])
    assert one.choices[0].text.endswith(f"Score: {verdict('a list of one'):.2f}")
    assert judge.stats()["accepted"] == 2  # each one call, at the judge's /v1/completions
    for bad, param in [({"prompt": ["two", "prompts"]}, "prompt"), ({"prompt": [1, 2]}, "prompt"),
                       ({"prompt": "x", "stream": True}, "stream"),
                       ({"prompt": "x", "model": "claude"}, "model")]:
        with pytest.raises(openai.BadRequestError) as refused:
            completions.create(**{"model": "judge", **bad})
        assert refused.value.body["param"] == param and param in str(refused.value), bad
    with pytest.raises(openai.BadRequestError, match="anthropic dialect"):
        completions.create(model="claude", prompt="x")
    assert judge.stats()["requests"] == 2  # none of the refused ones was sent
    with pytest.raises(openai.AuthenticationError):
        client(gateway, key="not-a-key-at-all").completions.create(model="judge", prompt="x")
    with pytest.raises(openai.InternalServerError) as unserved:
        completions.create(model="lonely", prompt="x")
    assert unserved.value.status_code == 503 and "no live worker" in str(unserved.value)
    # a route's cache answers a text completion at temperature 0 as it does a chat request
    cached = {"model": "cached", "prompt": "cache me too", "temperature": 0}
    first = completions.with_raw_response.create(**cached)
    assert completions.with_raw_response.create(**cached).headers.get("x-qrq-cache") == "hit"
    assert json.loads(first.content)["object"] == "text_completion"


def test_a_deadline_refusal_is_a_429_the_client_does_not_retry(gateway):
    judge = gateway["judge"]
    judge.reset()
    chat = openai.OpenAI(base_url=gateway["url"] + "/v1", api_key=TEAM_A).chat.completions
    with pytest.raises(openai.RateLimitError) as refused:  # default max_retries=2
        chat.create(model="judge", extra_headers={"X-Qrq-Deadline-S": "0.5"},
                    messages=[{"role": "user", "content": "slow [[mock:hang]]"}])
    assert refused.value.code == "deadline_exceeded"
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert judge.stats()["requests"] <= 1  # the client sent it once (qrq had it once)


def test_the_rm_endpoints_take_keys_and_their_priorities(gateway):
    url = gateway["url"]
    sample = {"prompt": "2+2?", "response": "4", "label": "4"}
    assert requests.post(url + "/slime", json=sample, timeout=30).status_code == 401
    val = {**sample, "metadata": {"qrq_priority": "val"}}
    team_a = {"Authorization": f"Bearer {TEAM_A}"}
    refused = requests.post(url + "/slime", json=val, headers=team_a, timeout=30)
    assert refused.status_code == 403 and "val" in refused.text
    ok = requests.post(url + "/slime", json=val, timeout=30,
                       headers={"Authorization": f"Bearer {EVAL}"})
    assert ok.status_code == 200 and isinstance(ok.json(), float)
    body = {"query": ["2+2? 4"], "prompts": ["2+2?"], "labels": ["4"]}
    assert requests.post(url + "/get_reward", json=body, timeout=30).status_code == 401
    assert requests.post(url + "/get_reward", json=body, headers=team_a,
                         timeout=30).json()["extra_logs"]["qrq_ok"] == [1.0]
    assert requests.get(url + "/health", timeout=5).ok  # health needs no key


def test_a_jobs_budget_refuses_with_insufficient_quota(gateway):
    chat = client(gateway, key=TINY).chat.completions

    def refused() -> bool:
        try:
            chat.create(model="judge", messages=[{"role": "user", "content": "spend " * 8}])
        except openai.RateLimitError as exc:
            assert exc.code == "insufficient_quota" and "job 'tiny'" in str(exc)
            return True
        return False

    wait_for(refused, 20, "the job's budget to refuse", interval_s=0.2)
    rows = jobs_of(gateway)
    tiny = rows["tiny"]["total"]
    assert tiny["tokens_in"] + tiny["tokens_out"] >= 40 and tiny["calls"] <= 4


def test_the_cache_answers_the_same_request_at_temperature_0(gateway):
    judge = gateway["judge"]
    chat = client(gateway).chat.completions
    ask = {"model": "cached", "messages": [{"role": "user", "content": "cache me"}]}
    first = chat.with_raw_response.create(temperature=0, **ask)
    judge.reset()
    second = chat.with_raw_response.create(temperature=0, **ask)
    assert second.headers.get("x-qrq-cache") == "hit" and second.content == first.content
    assert judge.stats()["requests"] == 0
    warm = chat.with_raw_response.create(temperature=0.7, **ask)  # not cached: a new draw
    assert warm.headers.get("x-qrq-cache") is None and judge.stats()["requests"] == 1


def test_an_open_gateway_says_so_and_warns_when_it_listens_widely(gateway, tmp_path):
    config = tmp_path / "qrq.toml"
    config.write_text(f'workers_dir = "workers"\n[redis]\nurl = '
                      f'"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}"\n')
    (tmp_path / "workers").mkdir()
    with contextlib.ExitStack() as stack:
        _, log = start_gateway(stack, config, "--host", "0.0.0.0")
        text = log.read_text()
        assert "no [gateway] keys configured: every caller is served as one job" in text
        assert "warning: the gateway listens on 0.0.0.0 without authentication" in text
    assert "http://127.0.0.1:" in gateway["log"].read_text()  # the default binds loopback
    assert "without authentication" not in gateway["log"].read_text()
