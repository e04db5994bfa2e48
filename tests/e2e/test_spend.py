"""Spend you can see and cap: tokens and cost per backend in summary(), `qrq status` and the
exporter, and budgets shared by every worker through Redis.

Real Redis, real `qrq worker` processes, mock judges over HTTP; their own request and token
counters are the truth.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from support import expected, judge_backend, start_workers, wait_for, write_config
from test_chaos import hostile

import qreward_queue
from qreward_queue.cli.main import cli
from qreward_queue.ops import exporter
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn

PRICE = {"input_per_million": 2.0, "output_per_million": 8.0}


def samples_for(n: int, tag: str) -> list[dict]:
    return [{"prompt": f"{tag} question {i}", "response": f"answer {i}"} for i in range(n)]


def status_json(config_path) -> dict:
    shown = CliRunner().invoke(cli, ["status", "--json", "--config", str(config_path)])
    assert shown.exit_code == 0, shown.output
    return {row["backend"]: row for row in json.loads(shown.output)["backends"]}


def test_spend_per_backend_in_summary_status_and_the_exporter(tmp_path, redis_url, stack):
    # Given a priced judge that reports usage, and one whose replies carry none
    judge = stack.enter_context(spawn(MockJudgeSettings(latency_ms=5, latency_cv=0)))
    mute = hostile(stack, lambda body, _: (200, "application/json", json.dumps(
        {"choices": [{"message": {"content": "Score: 0.5"}}]})))
    config_path = write_config(tmp_path, {
        "j": {**judge_backend(judge.url), "price": PRICE},
        "mute": judge_backend(mute.url),
    }, redis_url=redis_url)
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    workers = start_workers(config_path, [("j", "spend@test"), ("mute", "mute@test")])
    for worker in workers:
        stack.callback(worker.kill)
    # When a batch is scored on each
    samples = samples_for(120, "spend")
    batch = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=60)
    assert [o.score for o in batch.outcomes()] == [expected(app, "j", s) for s in samples]
    muted = qreward_queue.submit_batch(samples[:10], route="mute", app=app, deadline_s=60)
    assert {o.status for o in muted.outcomes()} == {"ok"}
    # Then summary() has what the judge itself counted: calls, tokens in and out, and cost
    truth = judge.stats()
    spent = batch.summary()["spend"]
    cost = (truth["prompt_tokens"] * 2.0 + truth["completion_tokens"] * 8.0) / 1e6
    assert spent == {"j": {"calls": truth["requests"], "tokens_in": truth["prompt_tokens"],
                           "tokens_out": truth["completion_tokens"], "estimated_calls": 0,
                           "cost": round(cost, 6)}}, (spent, truth)
    assert truth["requests"] == 120
    # and replies without usage are counted at their estimate, marked as such (no price: 0)
    (mute_spend,) = muted.summary()["spend"].values()
    assert mute_spend["calls"] == mute_spend["estimated_calls"] == 10, mute_spend
    assert mute_spend["tokens_in"] > 0 and mute_spend["cost"] == 0.0
    # and `qrq status` shows each backend's totals (written within the workers' flush
    # period), in JSON and in the table
    totals = {"j": spent["j"], "mute": mute_spend}

    def written() -> dict | None:
        rows = status_json(config_path)
        return rows if all(rows[b]["spend"]["total"] == totals[b] for b in totals) else None

    rows = wait_for(written, 10, "the totals")
    assert rows["j"]["spend"]["total"] == spent["j"], rows["j"]
    assert rows["j"]["spend"]["this_hour"] == spent["j"]
    table = CliRunner().invoke(cli, ["status", "--config", str(config_path)]).output
    assert (f"j: spent 120 calls, {truth['prompt_tokens']:,} tokens in, "
            f"{truth['completion_tokens']:,} out, cost {cost:.4f}") in table, table
    assert "mute: spent 10 calls" in table and "(10 estimated)" in table, table
    # and the exporter's counters
    families = {f.name: f for f in exporter.RedisStateCollector(app).collect()}
    tokens = {(s.labels["backend"], s.labels["direction"]): s.value
              for s in families["qrq_spend_tokens"].samples}
    assert tokens[("j", "in")] == truth["prompt_tokens"]
    assert tokens[("j", "out")] == truth["completion_tokens"]
    costs = {s.labels["backend"]: s.value for s in families["qrq_spend_cost"].samples}
    assert abs(costs["j"] - cost) < 1e-6


def test_a_budget_stops_calls_fails_over_and_names_itself(tmp_path, redis_url, stack):
    # Given judge j capped at 3,000 tokens in total, with an uncapped sibling k on one route
    judges = {n: stack.enter_context(spawn(MockJudgeSettings(latency_ms=20, latency_cv=0)))
              for n in ("j", "k")}
    cap = 3000
    config_path = write_config(tmp_path, {
        "j": {**judge_backend(judges["j"].url, calls=4), "budget": {"tokens_total": cap}},
        "k": judge_backend(judges["k"].url, calls=4),
    }, redis_url=redis_url, routes={"both": ["j", "k"]})
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    workers = start_workers(config_path, [("j", "j@budget"), ("k", "k@budget")])
    for worker in workers:
        stack.callback(worker.kill)
    # When more work than the cap allows is scored on the route
    samples = samples_for(200, "budget")
    outcomes = qreward_queue.submit_batch(samples, route="both", app=app,
                                          deadline_s=90).outcomes()
    # Then every sample is scored: what j could not take failed over to k
    assert {o.status for o in outcomes} == {"ok"}, [o for o in outcomes if o.status != "ok"][:3]
    by_backend = {b: sum(o.backend == b for o in outcomes) for b in ("j", "k")}
    assert by_backend["j"] > 0 and by_backend["k"] > 0, by_backend
    j_truth = judges["j"].stats()
    assert j_truth["prompt_tokens"] + j_truth["completion_tokens"] <= cap, j_truth
    assert j_truth["requests"] == by_backend["j"]
    # And on j alone, no call is made: each sample is an error naming the budget
    alone = qreward_queue.submit_batch(samples_for(5, "over"), route="j", app=app,
                                       deadline_s=60).outcomes()
    assert {o.status for o in alone} == {"error"}
    assert all("budget tokens_total = 3000 of backend 'j' reached" in o.error for o in alone)
    assert judges["j"].stats()["requests"] == j_truth["requests"]
    # and `qrq status` shows the cap, what is used and what is left (once the workers' flush
    # has given back what the calls booked)
    used = j_truth["prompt_tokens"] + j_truth["completion_tokens"]
    want = {"limit": cap, "used": used, "left": cap - used}
    wait_for(lambda: status_json(config_path)["j"]["spend"]["budgets"]["tokens_total"] == want,
             10, f"the budget's figures {want}")
    table = CliRunner().invoke(cli, ["status", "--config", str(config_path)]).output
    assert f"j: budget tokens_total 3,000: {used:,} used, {cap - used:,} left" in table, table


CAP = 6000


@pytest.mark.parametrize(("text", "judge_settings"), [
    ("ascii", {}),
    ("cjk", {"token_chars": 1.0}),  # about one token a character, 4x the usual estimate
    ("ascii", {"usage": False}),  # replies say nothing of their tokens
], ids=["ascii", "cjk", "no-usage"])
def test_a_token_budget_holds_on_the_tokens_the_judge_counts(
    tmp_path, redis_url, stack, text, judge_settings
):
    # Given a judge counting tokens its own way, two workers with 32 calls in flight each,
    # and a cap of 6,000 tokens in all
    judge = stack.enter_context(spawn(MockJudgeSettings(latency_ms=30, **judge_settings)))
    config_path = write_config(tmp_path, {
        "j": {**judge_backend(judge.url, calls=32), "budget": {"tokens_total": CAP}},
    }, redis_url=redis_url)
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    for worker in start_workers(config_path, [("j", "b1@budget"), ("j", "b2@budget")]):
        stack.callback(worker.kill)
    word = "答案是四十二" if text == "cjk" else "the answer is 42"
    samples = [{"prompt": f"question {i}: " + word * 4, "response": word * 3}
               for i in range(400)]
    # When far more is sent than the cap allows
    batch = qreward_queue.submit_batch(samples, route="j", app=app, deadline_s=120)
    outcomes = batch.outcomes()
    # Then the judge's own count ends within 1% of the cap (calls in flight when it was
    # reached booked their upper bound), every sample has an outcome, the rest name the cap;
    # with usage in the replies the cap is used well, without it each call counts at its
    # bound (a token a byte) and the budget stops early rather than late
    truth = judge.stats()
    used = truth["prompt_tokens"] + truth["completion_tokens"]
    least = CAP * 0.5 if judge_settings.get("usage", True) else 0
    assert least < used <= CAP * 1.01, (used, truth)
    refused = [o for o in outcomes if o.status != "ok"]
    assert refused and all("budget tokens_total = 6000 of backend 'j' reached" in o.error
                           for o in refused), refused[:2]
    # and the spend shown never says less than the judge counted (marked estimated when
    # the replies gave no usage)
    (spent,) = batch.summary()["spend"].values()
    assert spent["tokens_in"] + spent["tokens_out"] >= used, (spent, truth)
    assert spent["estimated_calls"] == (0 if judge_settings.get("usage", True)
                                        else spent["calls"])
