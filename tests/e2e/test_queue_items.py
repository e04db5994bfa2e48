"""Items on a qrq queue that are not task messages (issue 34): whatever a stranger pushes onto a
queue's Redis list ends as a task run or as a dead letter naming why, and the worker that pops
it stays up (before: `x`, `[1]` or `"headers": 7` killed it inside kombu's decoding).
"""

from __future__ import annotations

import base64
import copy
import json
import random
import time

from click.testing import CliRunner
from support import expected, judge_backend, start_workers, tasks_received, wait_for, write_config

import qreward_queue
from qreward_queue.cli.main import cli
from qreward_queue.ops import dead_letter
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn

QUEUE_KEY = "qrq:qrq.j"  # kombu's list for priority 0 of backend j's queue
SEED = 34
RANDOM_ITEMS = 60


def real_envelope(app, redis_client) -> dict:
    """The envelope kombu stores for a real score_chunk task on qrq.j (published to a scratch
    list, where no worker takes it)."""
    body = [[], {"backend": "j", "route": ["j"], "deadline": time.time() + 600,
                 "samples": [{"prompt": "p", "response": "r"}], "batch": "b", "indices": [0]},
            None]
    headers = app.amqp.as_task_v2("fuzz", "qrq.score_chunk", expires=600).headers
    with app.connection_for_write() as conn:
        conn.Producer(serializer="json").publish(
            body, routing_key="qrq.scratch", priority=0, headers=headers)
    envelope = json.loads(redis_client.rpop("qrq:qrq.scratch"))
    envelope["properties"]["delivery_info"]["routing_key"] = "qrq.j"
    return envelope


def changed(envelope: dict, path: tuple, value) -> bytes:
    """`envelope` with the value at `path` replaced (or deleted when `value` is DELETE)."""
    out = copy.deepcopy(envelope)
    *parents, last = path
    node = out
    for key in parents:
        node = node[key]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return json.dumps(out).encode()


DELETE = object()


def curated(envelope: dict) -> list[tuple[bytes, str]]:
    """(item, a part of the reason its dead letter must give): one per way to be wrong."""
    props = ("properties",)
    b64 = base64.b64encode
    return [
        (b"x", "not a JSON envelope"),
        (b"\xff\xfe{", "not a JSON envelope"),
        (b"[" * 50_000, "not a JSON envelope (RecursionError"),
        (b'{"__type__": "uuid", "__value__": "nope"}', "not a JSON envelope"),
        (b"[1]", "the envelope must be an object, got a list of 1"),
        (b"null", "the envelope must be an object, got null"),
        (b'"str"', "the envelope must be an object, got str"),
        (changed(envelope, ("headers",), 7), "envelope 'headers' must be an object, got 7"),
        (changed(envelope, ("headers",), None), "envelope 'headers' must be an object"),
        (changed(envelope, ("body",), 5), "envelope 'body' must be text, got 5"),
        (changed(envelope, ("body",), DELETE), "envelope 'body' must be text, got nothing"),
        (changed(envelope, ("body",), "!!not base64"), "envelope 'body' is not base64"),
        (changed(envelope, ("content-type",), [1]), "envelope 'content-type' must be text"),
        (changed(envelope, ("content-encoding",), {}), "'content-encoding' must be text"),
        (changed(envelope, props, DELETE), "envelope 'properties' must be an object, got null"),
        (changed(envelope, props, 5), "envelope 'properties' must be an object, got 5"),
        (changed(envelope, (*props, "delivery_tag"), [1]), "'delivery_tag' must be text"),
        (changed(envelope, (*props, "delivery_tag"), DELETE), "got nothing"),
        (changed(envelope, (*props, "delivery_info"), DELETE), "'delivery_info' must be an obj"),
        (changed(envelope, (*props, "delivery_info", "routing_key"), DELETE), "'delivery_info'"),
        (changed(envelope, (*props, "body_encoding"), "rot13"), "'body_encoding' must be"),
        (changed(envelope, (*props, "body_encoding"), 5), "'body_encoding' must be"),
        (changed(envelope, (*props, "priority"), "high"), "'priority' must be a whole number"),
        (changed(envelope, (*props, "reply_to"), {"a": 1}), "'reply_to' must be text"),
        (changed(envelope, ("headers", "id"), ""), "header(s) id missing, empty or not text"),
        # a well-formed envelope whose message Celery cannot decode (no `task` header: the
        # protocol-1 path, which Celery logged and dropped without a trace)
        (changed(changed_json(envelope, ("headers",), {}), ("body",), b64(b"{no").decode()),
         "undecodable task message"),
        # or whose `compression` header names no codec
        (changed(envelope, ("headers", "compression"), "bogus"),
         "undecodable task message: 'bogus'"),
    ]


def changed_json(envelope: dict, path: tuple, value) -> dict:
    return json.loads(changed(envelope, path, value))


JUNK = [7, "x", [1], {}, None, True, -1, 1.5, "", [[]], {"a": 1}, "2026-13-01", DELETE]


def paths(node, prefix=()) -> list[tuple]:
    """Every key path in the envelope, not into the (base64) body."""
    out = []
    if isinstance(node, dict):
        for key, value in node.items():
            out.append((*prefix, key))
            out += paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out.append((*prefix, i))
            out += paths(value, (*prefix, i))
    return out


def random_items(envelope: dict, rng: random.Random, n: int) -> list[bytes]:
    """Seeded mutations of a real task's envelope: a value of another kind at any path, a key
    gone, the bytes cut short or a byte flipped."""
    raw = json.dumps(envelope).encode()
    every = paths(envelope)
    out = []
    for _ in range(n):
        roll = rng.random()
        if roll < 0.7:
            out.append(changed(envelope, rng.choice(every), rng.choice(JUNK)))
        elif roll < 0.85:
            out.append(raw[: rng.randrange(len(raw))])
        else:
            i = rng.randrange(len(raw))
            out.append(raw[:i] + bytes([rng.randrange(256)]) + raw[i + 1:])
    return out


def test_no_item_on_a_queue_kills_the_worker_and_each_ends_as_a_run_or_a_dead_letter(
    tmp_path, redis_url, redis_client, stack
):
    # Given one worker on a judge's queue, and the envelope of a real task
    judge = stack.enter_context(spawn(MockJudgeSettings(latency_ms=5)))
    config_path = write_config(tmp_path, {"j": judge_backend(judge.url)}, redis_url=redis_url)
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    (worker,) = start_workers(config_path, [("j", "items@fuzz")])
    stack.callback(worker.kill)
    envelope = real_envelope(app, redis_client)
    cases = curated(envelope)
    fuzz = random_items(envelope, random.Random(SEED), RANDOM_ITEMS)
    # When each curated item is pushed onto the queue's list as a stranger would
    for item, _ in cases:
        redis_client.lpush(QUEUE_KEY, item)
    wait_for(lambda: redis_client.llen(dead_letter.DEAD_LETTER_KEY) >= len(cases), 30,
             "every curated item to be dead-lettered")
    # Then each is kept once with its reason, in the order pushed, and none ran
    letters = dead_letter.read(redis_client, limit=len(cases) + 1)[::-1]
    assert len(letters) == len(cases), [d["reason"] for d in letters]
    for (item, reason), letter in zip(cases, letters, strict=True):
        assert reason in letter["reason"], (item[:80], letter["reason"])
        assert letter["queue"] == "qrq.j", letter
    assert letters[0]["item"] == "x" and letters[1]["item"] == "\\xff\\xfe{", letters[:2]
    assert tasks_received(worker) == 0
    # When the seeded random items follow
    for item in fuzz:
        redis_client.lpush(QUEUE_KEY, item)

    def accounted() -> bool:
        ended = redis_client.llen(dead_letter.DEAD_LETTER_KEY) - len(cases) + tasks_received(worker)
        return redis_client.llen(QUEUE_KEY) == 0 and ended == len(fuzz)

    # Then every one of them ended as a task run or a dead letter (none vanished)...
    wait_for(accounted, 60, "every random item to end as a task run or a dead letter")
    log = worker.log.read_text()
    assert worker.proc.poll() is None and "Unrecoverable error" not in log, log[-3000:]
    # ...and the same worker scores a real batch right after
    samples = [{"prompt": f"after fuzz {i}", "response": f"answer {i}"} for i in range(12)]
    outcomes = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=60).outcomes()
    assert [o.status for o in outcomes] == ["ok"] * len(samples), outcomes
    assert [o.score for o in outcomes] == [expected(app, "j", s) for s in samples]
    assert worker.proc.poll() is None
    # and `qrq dead-letters` shows them
    shown = CliRunner().invoke(cli, ["dead-letters", "--config", str(config_path),
                                     "--limit", "1000"])
    assert shown.exit_code == 0, shown.output
    listed = [json.loads(line) for line in shown.output.splitlines()]
    assert len(listed) == redis_client.llen(dead_letter.DEAD_LETTER_KEY) >= len(cases)


def test_a_real_task_envelope_passes_the_envelope_check(redis_url, redis_client, tmp_path):
    config_path = write_config(tmp_path, {"j": judge_backend("http://127.0.0.1:9")},
                               redis_url=redis_url)
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    item = json.dumps(real_envelope(app, redis_client)).encode()
    assert dead_letter.envelope_problem(item) is None
