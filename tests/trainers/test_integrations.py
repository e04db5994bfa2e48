"""Contract tests: each adapter called exactly as its trainer calls it, against real Redis, a
real `qrq worker` and the mock judge with injected 500s and hangs.

Call sites mirrored (see /work/shared/reference/trainers.md):
- verl 0.9.1 (= verl-project/verl 1dda039): reward_loop/reward_manager/naive.py
  `_compute_score_for_response` (keyword call of an async compute_score) and `run_single`
  (DataProto of the trajectory; data[-1]); RewardLoopManager.compute_rm_score assembling
  `np.array([info[k] for info in infos])` over sample 0's keys.
- TRL 1.16.0 grpo_trainer.py `_calculate_rewards`: keyword call with the dataset columns,
  awaited via run_coroutine_threadsafe on a daemon-thread loop.
- slime 624b824 rm_hub `async_rm` / `batched_async_rm`: `await rm(args, sample)` and
  `await rm(args, samples)`.
- OpenRLHF 0.11.2 file mode: `reward_func(queries, prompts, labels)` via asyncio.to_thread.
- AReaL 1.0.4 workflow/rlvr.py `_compute_rewards(resp, prompt_str, task_data)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import sys
import threading
import types
from dataclasses import dataclass, field

import numpy as np
import pytest
import redis
from conftest import REDIS_DB, REDIS_HOST, REDIS_PORT
from trainer_stack import FALLBACK, judge_score, start_stack

from qreward_queue.errors import ConfigError, ScoringError
from qreward_queue.integrations import areal, openrlhf, slime, trl, verl
from qreward_queue.integrations.coerce import make_sample

OK, FAIL_500, HANG = "The answer is 4.", "Sorry [[mock:500]]", "Thinking [[mock:hang]]"
RESPONSES = [OK, FAIL_500, "It is 5.", HANG]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=REDIS_DB)
    client.flushdb()
    client.close()
    with contextlib.ExitStack() as stack:
        app, *_ = start_stack(stack, tmp_path_factory.mktemp("integrations"),
                             f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}")
        yield app


@pytest.fixture(autouse=True)
def no_embedded_workers_left():
    """Overrides conftest's: the module's app stays configured across its tests."""
    yield


def check_failure_mapping(app, prompts, outcomes_scores, scored_value, failed_value):
    """RESPONSES[0] and [2] are judged; [1] (500) and [3] (hang) map to `failed_value`."""
    for i, (prompt, got) in enumerate(zip(prompts, outcomes_scores, strict=True)):
        if RESPONSES[i % 4] in (FAIL_500, HANG):
            assert got == failed_value, (i, got)
        else:
            want = judge_score(app, make_sample(prompt, RESPONSES[i % 4], "4"))
            assert got == scored_value(want), (i, got, want)


# -- verl ---------------------------------------------------------------------------------------

def verl_extra_info(i: int) -> dict:
    """What verl's naive manager hands over: the row's extra_info, mutated in place."""
    return {"question": f"Q{i}: what is 2+2?", "split": "train", "index": np.int64(i),
            "num_turns": np.int64(2), "rollout_reward_scores": {}}


def assemble_like_verl(infos: list[dict]) -> dict:
    keys = list(infos[0])  # RewardLoopManager.compute_rm_score: sample 0's keys
    return {k: np.array([info[k] for info in infos]) for k in keys}


def test_verl_compute_score_is_a_plain_async_function_called_by_keyword(app):
    assert inspect.iscoroutinefunction(verl.compute_score)  # else verl runs it in a thread

    async def naive_calls():
        return await asyncio.gather(*(
            verl.compute_score(data_source=np.str_("gsm8k"), solution_str=RESPONSES[i % 4],
                               ground_truth=["4"] if i % 2 else 4, extra_info=verl_extra_info(i),
                               route="judge")
            for i in range(8)))

    results = asyncio.run(naive_calls())
    assert {frozenset(r) for r in results} == {frozenset({"score", *verl.EXTRA_KEYS})}
    assert all(v is not None for r in results for v in r.values())
    prompts = [verl_extra_info(i)["question"] for i in range(8)]
    # the judge sees the reference as text: 4 and ["4"] are coerced, not rejected
    for i, r in enumerate(results):
        if RESPONSES[i % 4] in (OK, "It is 5."):
            ref = '["4"]' if i % 2 else "4"
            assert r["score"] == judge_score(app, make_sample(prompts[i], RESPONSES[i % 4], ref))
            assert (r["qrq_ok"], r["qrq_status"], r["qrq_backend"]) == (1.0, "ok", "judge")
        else:
            assert (r["score"], r["acc"], r["qrq_ok"]) == (FALLBACK, FALLBACK, 0.0)
            assert r["qrq_status"] in ("error", "timeout")
    table = assemble_like_verl([{k: v for k, v in r.items() if k != "score"} for r in results])
    assert table["qrq_ok"].tolist() == [0.0 if RESPONSES[i % 4] in (FAIL_500, HANG) else 1.0
                                        for i in range(8)]


class Item:
    def __init__(self, batch, non_tensor_batch):
        self.batch, self.non_tensor_batch = batch, non_tensor_batch


class Trajectory:
    """DataProto's surface that run_single uses: `data[-1]` -> an item with .batch (tensors)
    and .non_tensor_batch (numpy object values)."""

    def __init__(self, items):
        self.items = items

    def __getitem__(self, index):
        return self.items[index]


class WordTokenizer:
    """decode(ids, skip_special_tokens) over a fixed vocabulary; 0 = pad, 1 = eos."""

    vocab = ("<pad>", "<eos>", "Q:", "2+2?", *RESPONSES)

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(self.vocab[int(i)] for i in ids
                        if not (skip_special_tokens and int(i) < 2))


def trajectory(i: int, raw_prompt: bool = True) -> Trajectory:
    prompt_ids, response_ids = np.array([0, 2, 3]), np.array([4 + i % 4, 1, 0, 0])
    mask = np.array([0, 1, 1, 1, 1, 1, 0, 0])
    nt = {"data_source": np.str_("gsm8k"), "reward_model": {"ground_truth": np.int64(4)},
          "extra_info": verl_extra_info(i), "uid": f"u{i}", "__num_turns__": np.int64(2)}
    if raw_prompt:
        nt["raw_prompt"] = np.array([{"role": "user", "content": f"Q{i}: 2+2?"}], dtype=object)
    return Trajectory([Item({"prompts": prompt_ids, "responses": response_ids,
                             "attention_mask": mask}, nt)])


def test_verl_reward_manager_run_single_sees_the_prompt_and_keeps_one_key_set(app):
    config = {"reward": {"qrq": {"route": "judge"}}}
    manager = verl.QrqRewardManager(config, WordTokenizer(), None)

    async def workers():
        return await asyncio.gather(*(manager.run_single(trajectory(i, i < 6)) for i in range(8)))

    results = asyncio.run(workers())
    prompts = [f"Q{i}: 2+2?" if i < 6 else verl_extra_info(i)["question"] for i in range(8)]
    check_failure_mapping(app, prompts, [r["reward_score"] for r in results],
                          lambda want: want, FALLBACK)
    infos = [r["reward_extra_info"] for r in results]
    assert {frozenset(i) for i in infos} == {frozenset(verl.EXTRA_KEYS)}
    assert assemble_like_verl(infos)["acc"].tolist() == [r["reward_score"] for r in results]


def test_verl_can_raise_on_unscored_so_the_v1_trainer_drops_the_trajectory(app):
    manager = verl.QrqRewardManager({"reward": {"qrq": {"route": "judge",
                                                        "on_unscored": "raise"}}},
                                    WordTokenizer(), None)
    with pytest.raises(ScoringError, match="could not score"):
        asyncio.run(manager.run_single(trajectory(1)))
    assert asyncio.run(manager.run_single(trajectory(0)))["reward_extra_info"]["qrq_ok"] == 1.0


def test_verl_validation_rows_are_sent_as_val():
    assert verl.priority_of({"split": "test"}) == "val"
    assert verl.priority_of({"split": "train"}) == "train"
    assert verl.priority_of({"split": "test", "qrq_priority": "bulk"}) == "bulk"
    assert verl.priority_of(None) == "train"


# -- TRL ----------------------------------------------------------------------------------------

def call_like_trl(func, **kwargs):
    """TRL awaits async reward functions on a daemon-thread loop, from the training thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        return asyncio.run_coroutine_threadsafe(func(**kwargs), loop).result(120)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


@pytest.mark.parametrize("conversational", [False, True])
def test_trl_reward_returns_none_for_unscored_and_logs_statuses(app, conversational):
    reward = trl.qrq_reward("judge", name="judge_reward")
    assert reward.__name__ == "judge_reward" and inspect.iscoroutinefunction(reward)
    prompts = [f"T{i}: 2+2?" for i in range(8)]
    completions = [RESPONSES[i % 4] for i in range(8)]
    if conversational:
        prompts = [[{"role": "user", "content": p}] for p in prompts]
        completions = [[{"role": "assistant", "content": c}] for c in completions]
    logged, metrics = {}, {}
    scores = call_like_trl(
        reward, prompts=prompts, completions=completions, completion_ids=[[1]] * 8,
        solution=["4"] * 8, route="ignored-column", trainer_state=None,
        log_extra=logged.__setitem__, log_metric=metrics.__setitem__)
    check_failure_mapping(app, [f"T{i}: 2+2?" for i in range(8)], scores,
                          lambda want: want, None)
    assert logged["judge_reward_status"][:2] == ["ok", "error"]
    assert metrics["judge_reward/unscored_frac"] == 0.5
    # and the step's summary: samples by status, retries
    statuses = {k.split("/")[1]: v for k, v in metrics.items()
                if k.split("/")[1] in ("ok", "error", "timeout", "cached")}
    assert sum(statuses.values()) == 8 and statuses["ok"] == 4, metrics
    assert metrics["judge_reward/retries"] >= 0


# -- slime --------------------------------------------------------------------------------------

@dataclass
class Sample:
    """The fields of slime.utils.types.Sample (624b824) the RM path touches."""

    prompt: str | list[dict] = ""
    response: str = ""
    label: str | None = None
    reward: float | dict | None = None
    metadata: dict = field(default_factory=dict)
    remove_sample: bool = False
    index: int | None = None


def test_slime_rm_accepts_one_sample_or_a_group(app, monkeypatch):
    monkeypatch.setenv("QRQ_ROUTE", "judge")
    args = types.SimpleNamespace(group_rm=False)
    group = [Sample([{"role": "user", "content": f"S{i}: 2+2?"}], RESPONSES[i % 4], "4",
                    index=i) for i in range(4)]
    single = Sample("S9: 2+2?", OK, "4", metadata={"qrq_priority": "val"})

    async def rollout():
        return await asyncio.gather(slime.rm(args, group), slime.rm(args, single))

    group_scores, single_score = asyncio.run(rollout())
    check_failure_mapping(app, [f"S{i}: 2+2?" for i in range(4)], group_scores,
                          lambda want: want, FALLBACK)
    assert [s.remove_sample for s in group] == [False, True, False, True]
    assert [s.metadata["qrq_status"] for s in group][0::2] == ["ok", "ok"]
    assert single_score == judge_score(app, make_sample("S9: 2+2?", OK, "4"))
    assert not single.remove_sample


# -- OpenRLHF (file mode; the HTTP mode is tests/e2e/test_gateway.py) ------------------------------

def test_openrlhf_reward_func_strips_the_prompt_and_eos_and_always_returns_numbers(app,
                                                                                 monkeypatch):
    monkeypatch.setenv("QRQ_ROUTE", "judge")
    prompts = [f"<|im_start|>user\nO{i}: 2+2?<|im_end|>\n<|im_start|>assistant\n"
               for i in range(4)]

    async def executors():
        return await asyncio.gather(*(
            asyncio.to_thread(openrlhf.reward_func, [p + RESPONSES[i] + "<|im_end|>"], [p], ["4"])
            for i, p in enumerate(prompts)))

    replies = asyncio.run(executors())
    check_failure_mapping(app, prompts, [r["rewards"][0] for r in replies],
                          lambda want: want, FALLBACK)
    assert [r["extra_logs"]["qrq_ok"] for r in replies] == [[1.0], [0.0], [1.0], [0.0]]
    assert all(r["scores"] == r["rewards"] for r in replies)


# -- AReaL --------------------------------------------------------------------------------------

class RLVRWorkflow:
    """areal.workflow.rlvr.RLVRWorkflow's reward step (1.0.4), without generation."""

    def __init__(self, reward_fn, gconfig, tokenizer):
        self.reward_fn, self.gconfig, self.tokenizer = reward_fn, gconfig, tokenizer

    async def _compute_rewards(self, resp, prompt_str, task_data):
        raise AssertionError("the mixin must replace this")


class QrqRLVRWorkflow(areal.QrqRewardMixin, RLVRWorkflow):
    qrq_route = "judge"


@pytest.fixture
def areal_context(monkeypatch):
    """areal.infra.workflow_context.get().is_eval, as a ContextVar like AReaL's."""
    import contextvars

    flag = contextvars.ContextVar("is_eval", default=False)
    context = types.ModuleType("areal.infra.workflow_context")
    context.get = lambda: types.SimpleNamespace(is_eval=flag.get())
    infra = types.ModuleType("areal.infra")
    infra.workflow_context = context
    for name, module in [("areal", types.ModuleType("areal")), ("areal.infra", infra),
                         ("areal.infra.workflow_context", context)]:
        monkeypatch.setitem(sys.modules, name, module)
    return flag


def test_areal_workflow_scores_on_qrq_and_rejects_unscored(app, areal_context):
    workflow = QrqRLVRWorkflow(areal.unused_reward_fn, None, WordTokenizer())
    resp = types.SimpleNamespace(input_tokens=[2, 3], output_tokens=[4, 1])

    async def episode(output_tokens, is_eval=False):
        areal_context.set(is_eval)
        assert areal.is_eval() is is_eval
        resp.output_tokens = output_tokens
        return await workflow._compute_rewards(resp, "A: 2+2?", {"answer": "4", "id": 1})

    assert asyncio.run(episode([4, 1], True)) == judge_score(app, make_sample("A: 2+2?", OK, "4"))
    with pytest.raises(ScoringError):
        asyncio.run(episode([5, 1]))
    workflow.qrq_on_unscored = "fallback"
    assert asyncio.run(episode([5, 1])) == FALLBACK


# -- embedded mode ------------------------------------------------------------------------------

def test_embedded_mode_is_refused_under_multi_process_trainers(app, tmp_path, monkeypatch,
                                                                 capsys):
    from support import write_config

    from qreward_queue.integrations import guard
    from qreward_queue.trainer.runtime import configure

    monkeypatch.delenv("QRQ_REDIS_URL", raising=False)
    monkeypatch.delenv("QRQ_ALLOW_EMBEDDED", raising=False)
    try:
        configure(write_config(tmp_path, {}, None))
        with pytest.raises(ConfigError, match="QRQ_REDIS_URL"):
            verl.QrqRewardManager({}, WordTokenizer())
        monkeypatch.setenv("QRQ_ALLOW_EMBEDDED", "1")
        monkeypatch.setattr(guard, "_noted", set())  # as in a fresh process
        capsys.readouterr()
        verl.QrqRewardManager({}, WordTokenizer())
        verl.QrqRewardManager({}, WordTokenizer())
        # allowed: one calm line per process, no warning with a source line under it
        assert capsys.readouterr().err.splitlines() == [
            "qrq: embedded mode under verl (QRQ_ALLOW_EMBEDDED=1): the judge's limits hold "
            "within this process"]
    finally:
        configure(app.qrq_config)  # back to the module's distributed stack
