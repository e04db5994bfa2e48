"""Group mode end to end: a real `qrq worker`, real Redis, the mock judge over HTTP.

A judge backend with `mode = "group"` scores each GRPO group in one call: every response gets
the mock's deterministic score for it (rm_verdict of the group's head and the response), a
group larger than `group_max` is judged in balanced parts, a reply without one valid score per
response is an `error` for every sample of its group (quoting the reply) and for no other.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import random
from types import SimpleNamespace

import pytest
from support import judge_backend, write_route_config

import qreward_queue
from qreward_queue.backends import make_backend
from qreward_queue.backends.groups import DEFAULT_GROUP_TEMPLATE, render_group
from qreward_queue.config.loader import load_backend
from qreward_queue.errors import ConfigError
from qreward_queue.integrations import slime
from qreward_queue.ops.plan import Workload, plan_route
from qreward_queue.samples import Outcome
from qreward_queue.testing.mock_judge import MockJudgeSettings, rm_verdict, spawn, split_group
from qreward_queue.trainer.batcher import MicroBatcher

GROUP_MAX = 4


def grpo(groups: int, size: int, marker: str = "", start: int = 0) -> list[dict]:
    return [{"prompt": f"Problem {g}: {g} + {g}?{marker}",
             "response": f"answer {g}-{r}: {2 * g + r % 2}"}
            for g in range(start, start + groups) for r in range(size)]


def group_config(tmp_path, url: str, redis_url: str | None, **backend):
    tables = judge_backend(url, mode="group", group_max=GROUP_MAX, **backend)
    path = write_route_config(tmp_path, {"gj": tables}, redis_url)
    return qreward_queue.load_config(path), path


def want(config, samples: list[dict]) -> list[float]:
    """The mock's score of each sample, judged in the calls the kind makes of the batch."""
    client = make_backend(config.backend("gj"))
    scores = [0.0] * len(samples)
    for call in client.split(samples):
        head, responses = split_group(render_group(DEFAULT_GROUP_TEMPLATE,
                                                   [samples[i] for i in call]))
        for i, response in zip(call, responses, strict=True):
            scores[i] = rm_verdict(head, response)
    return scores


@pytest.fixture
def judge(stack):
    return stack.enter_context(spawn(MockJudgeSettings(latency_ms=20, latency_cv=0.3)))


@pytest.fixture
def worker(tmp_path, judge, redis_url, stack):
    from support import Worker

    config, path = group_config(tmp_path, judge.url, redis_url)
    stack.enter_context(Worker(path, "gj"))
    return qreward_queue.configure(config)


def test_each_response_gets_its_own_score_in_one_call_per_group(worker, judge) -> None:
    samples = grpo(6, 4)  # 6 groups of 4 by prompt
    samples += [{**s, "group": "big"} for s in grpo(1, 10, start=50)]  # split 4 + 3 + 3
    samples += [{"prompt": "Same prompt", "response": "twice", "group": k} for k in (1, 1, 2)]
    outcomes = qreward_queue.submit_batch(samples, route="gj", app=worker).outcomes()
    assert [o.status for o in outcomes] == ["ok"] * len(samples)
    assert [o.score for o in outcomes] == want(worker.qrq_config, samples)
    stats = judge.stats()
    # group 1 holds the same response twice: dedup never shrinks a group, the judge sees both;
    # group 2 (the same text alone) is a group of its own
    assert stats["accepted"] == 6 + 3 + 2
    assert stats["items"] == len(samples)


def test_a_malformed_group_reply_fails_its_group_only_and_quotes_the_reply(worker, judge
                                                                           ) -> None:
    good = grpo(3, 4)
    few, dup, order = (grpo(1, 4, f" [[mock:group-{f}]]", start=10 + k)
                       for k, f in enumerate(("few", "dup", "order")))
    samples = good + few + dup + order
    outcomes = qreward_queue.submit_batch(samples, route="gj", app=worker).outcomes()
    expected = want(worker.qrq_config, samples)
    for i, outcome in enumerate(outcomes):
        if len(good) <= i < len(good) + 8:  # the few and dup groups: every sample an error
            assert outcome.status == "error", (i, outcome)
            assert "Scores:" in (outcome.detail or ""), outcome  # the reply, quoted
            assert outcome.score == 0.0
        else:  # the other groups are scored, a reply in reverse order (numbered) included
            assert (outcome.status, outcome.score) == ("ok", expected[i]), (i, outcome)
    assert "3 scores for 4 responses" in outcomes[len(good)].error
    assert "twice" in outcomes[len(good) + 4].error
    # a malformed reply is permanent: one call per group, never split to isolate an item
    assert judge.stats()["accepted"] == 6


def test_a_group_with_two_prompts_is_bad_input_named_per_sample(worker) -> None:
    samples = [{"prompt": "a", "response": "1", "group": "g"},
               {"prompt": "b", "response": "2", "group": "g"},
               {"prompt": "c", "response": "3", "group": 1.5}]
    with pytest.raises(qreward_queue.InvalidSamples) as caught:
        qreward_queue.submit_batch(samples, route="gj", app=worker)
    assert set(caught.value.problems) == {1, 2}
    outcomes = qreward_queue.submit_batch(samples, route="gj", on_invalid="outcome",
                                          app=worker).outcomes()
    assert [o.status for o in outcomes] == ["ok", "error", "error"]
    assert "another prompt" in outcomes[1].error and "'group'" in outcomes[2].error


def test_the_cache_keeps_whole_groups(tmp_path, judge, redis_url, stack) -> None:
    from support import Worker

    tables = judge_backend(judge.url, mode="group", group_max=GROUP_MAX)
    path = write_route_config(tmp_path, {"gj": tables}, redis_url,
                              routes={"cached": {"backends": ["gj"], "cache": True}})
    stack.enter_context(Worker(path, "gj"))
    app = qreward_queue.configure(qreward_queue.load_config(path))
    samples = grpo(2, 4)
    first = qreward_queue.submit_batch(samples, route="cached", app=app).outcomes()
    again = qreward_queue.submit_batch(samples, route="cached", app=app).outcomes()
    assert [o.status for o in again] == ["cached"] * 8
    assert [o.score for o in again] == [o.score for o in first]
    # the same responses in another group are another question: judged, not taken from cache
    regrouped = qreward_queue.submit_batch(samples[:2], route="cached", app=app).outcomes()
    assert [o.status for o in regrouped] == ["ok"] * 2
    assert judge.stats()["accepted"] == 3


def test_group_mode_keys_are_checked_with_one_line_naming_file_and_key(tmp_path) -> None:
    from support import toml_tables

    def load(**backend):
        path = tmp_path / "gj.toml"
        path.write_text(toml_tables(judge_backend("http://127.0.0.1:1", **backend)))
        return load_backend(path)

    assert load(mode="group").options.group_max == 16
    for bad, key in [({"mode": "pairs"}, "backend.mode"),
                     ({"mode": "group", "group_template": "no slot"}, "backend.group_template"),
                     ({"mode": "group", "group_pattern": r"(\d+)"}, "backend.group_pattern"),
                     ({"mode": "group", "group_max": 0}, "backend.group_max"),
                     ({"group_max": 8}, "backend.group_max")]:
        with pytest.raises(ConfigError) as caught:
            load(**bad)
        message = str(caught.value)
        assert "gj.toml" in message and key in message and "\n" not in message, message


def test_plan_counts_one_call_per_group(tmp_path) -> None:
    config, _ = group_config(tmp_path, "http://127.0.0.1:1", None)
    (p,) = plan_route(config, "gj", Workload(1024, group_size=4)).backends
    assert (p.samples_per_call, p.calls) == (4, 256)
    (p,) = plan_route(config, "gj", Workload(1024, group_size=8)).backends  # 8 -> 4 + 4
    assert (p.samples_per_call, p.calls) == (4, 256)


def _child_scores_groups(conn, samples: list[dict], batcher_size: int | None) -> None:
    """One trainer process: a coroutine per sample, in shuffled order, through a batcher
    that never sends a group before it is complete (its wait is longer than the test)."""
    batcher = MicroBatcher(max_items=64, max_wait_ms=20, group_wait_ms=600_000,
                           group_size=batcher_size)
    order = list(range(len(samples)))
    random.Random(len(samples)).shuffle(order)

    async def main() -> list[Outcome]:
        tasks = {i: asyncio.create_task(batcher.score(samples[i], "gj")) for i in order}
        return [await tasks[i] for i in range(len(samples))]

    conn.send([(o.status, o.score) for o in asyncio.run(main())])


def test_the_micro_batcher_completes_groups_from_many_processes_and_coroutines(worker, judge
                                                                               ) -> None:
    processes, per_process, size = 8, 128, 8  # 8 x 128 coroutines, groups of 8
    ctx = multiprocessing.get_context("fork")
    children = []
    everything: list[dict] = []
    for p in range(processes):
        samples = grpo(per_process // size, size, start=100 * p)
        if p % 2:  # the size said by the sample, else by the batcher (QRQ_BATCH_GROUP_SIZE)
            samples = [{**s, "group_size": size} for s in samples]
        receiver, sender = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_child_scores_groups,
                            args=(sender, samples, None if p % 2 else size))
        child.start()
        children.append((child, receiver, samples))
        everything += samples
    for child, receiver, samples in children:
        assert receiver.poll(120), "a trainer process got no outcomes"
        expected = want(worker.qrq_config, samples)
        assert receiver.recv() == [("ok", score) for score in expected]
        child.join(10)
    # every group was judged whole: as many calls as the kind makes of whole groups
    stats = judge.stats()
    client = make_backend(worker.qrq_config.backend("gj"))
    assert stats["accepted"] == len(client.split(everything)) == processes * per_process // 4
    assert stats["items"] == processes * per_process


def test_a_group_of_unknown_size_goes_after_the_group_wait_and_slime_lists_are_groups(
        worker, judge) -> None:
    batcher = MicroBatcher(max_items=64, max_wait_ms=5, group_wait_ms=300)
    samples = grpo(1, 3)

    async def main() -> list[Outcome]:
        return list(await asyncio.gather(*(batcher.score(s, "gj") for s in samples)))

    outcomes = asyncio.run(main())
    assert [o.score for o in outcomes] == want(worker.qrq_config, samples)
    assert judge.stats()["accepted"] == 1  # the three together, once the wait was over
    slime_samples = [SimpleNamespace(prompt="Problem 7: 7 + 7?", response=f"r{k}", label=None,
                                     metadata=None, remove_sample=False) for k in range(3)]
    scores = asyncio.run(slime.rm(SimpleNamespace(qrq_route="gj"), slime_samples))
    as_sent = [{"prompt": s.prompt, "response": s.response} for s in slime_samples]
    assert scores == want(worker.qrq_config, as_sent)
    assert judge.stats()["accepted"] == 2  # the list at once: one group, no wait


@pytest.mark.slow
def test_groups_stay_whole_through_a_killed_worker(tmp_path, redis_url, stack) -> None:
    from support import Worker, wait_for
    from test_worker_loss import in_flight_task_ids

    judge = stack.enter_context(spawn(MockJudgeSettings(latency_ms=200, latency_cv=0.3)))
    tables = judge_backend(judge.url, mode="group", group_max=GROUP_MAX, concurrency=4,
                           chunk_size=8)  # two groups a task: many tasks, some in flight
    path = write_route_config(tmp_path, {"gj": tables}, redis_url, visibility_timeout_s=10)
    app = qreward_queue.configure(qreward_queue.load_config(path))
    samples = grpo(60, GROUP_MAX)
    doomed = stack.enter_context(Worker(path, "gj", name="g1@%h"))
    stack.enter_context(Worker(path, "gj", name="g2@%h"))
    batch = qreward_queue.submit_batch(samples, route="gj", app=app, deadline_s=120)
    wait_for(lambda: batch.completed >= len(samples) // 3, timeout_s=60, what="a third done")
    doomed.kill()
    assert in_flight_task_ids(doomed.log.read_text()), "no task in flight: the test proves nothing"
    outcomes = batch.outcomes()
    assert [(o.status, o.score) for o in outcomes] == [("ok", s) for s in want(app.qrq_config,
                                                                               samples)]
    stats = judge.stats()  # every call the judge answered held one whole group
    assert stats["items"] == GROUP_MAX * stats["accepted"] >= len(samples)


def test_groups_fail_over_whole(tmp_path, judge, redis_url, stack) -> None:
    from support import free_port, start_workers, tasks_received

    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    tables = {name: judge_backend(url, mode="group", group_max=GROUP_MAX, chunk_size=8)
              for name, url in (("gj", judge.url), ("gdown", down))}
    tables["gdown"]["retry"] = {"attempts": 1, "backoff_base_s": 0.05}
    path = write_route_config(tmp_path, tables, redis_url,
                              routes={"pair": {"backends": ["gdown", "gj"]}})
    workers = start_workers(path, [("gj", "gj"), ("gdown", "gdown")])
    for worker in workers:
        stack.enter_context(worker)
    app = qreward_queue.configure(qreward_queue.load_config(path))
    samples = grpo(16, GROUP_MAX)
    outcomes = qreward_queue.submit_batch(samples, route="pair", app=app).outcomes()
    assert tasks_received(workers[1]) > 0, "nothing went to the down judge: no failover"
    assert [(o.status, o.score, o.backend) for o in outcomes] == [
        ("ok", s, "gj") for s in want(app.qrq_config, samples)]
    stats = judge.stats()  # the down judge's chunks came over whole: one call per group
    assert stats["accepted"] == 16 and stats["items"] == len(samples)
