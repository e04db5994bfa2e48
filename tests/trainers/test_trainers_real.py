"""Against the real trainer code (verl 0.9.1, TRL 1.16.0, OpenRLHF 0.11.2 --no-deps), CPU only.

Run by .ci/trainers.sh in its own virtualenv; skipped where a trainer is not installed. The
tokenizer and model are built in-process (no hub download). Real Redis, a real `qrq worker`
and the mock judge with injected faults, as in the contract tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import types
from pathlib import Path

import numpy as np
import pytest
import redis
from conftest import REDIS_DB, REDIS_HOST, REDIS_PORT
from support import start_gateway
from trainer_stack import FALLBACK, judge_score, start_stack

from qreward_queue.integrations import verl as qrq_verl
from qreward_queue.integrations.coerce import make_sample
from qreward_queue.trainer import batcher as batcher_module

pytest.importorskip("transformers", reason="trainer packages: run bash .ci/trainers.sh")

OK, FAIL_500 = "the answer is 4", "sorry [[mock:500]]"
WORDS = ["what", "is", "2+2?", "the", "answer", "4", "5", "sorry", "[[mock:500]]", "user",
         "assistant"]


@pytest.fixture(scope="module")
def stack_dir(tmp_path_factory):
    client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=REDIS_DB)
    client.flushdb()
    client.close()
    path = tmp_path_factory.mktemp("trainers")
    with contextlib.ExitStack() as stack:
        app, *_ = start_stack(stack, path, f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}")
        os.environ["QRQ_CONFIG"] = str(path / "qrq.toml")  # what Ray's runtime_env would set
        yield app, path, stack
        os.environ.pop("QRQ_CONFIG", None)


@pytest.fixture
def app(stack_dir):
    return stack_dir[0]


@pytest.fixture(autouse=True)
def no_embedded_workers_left():
    """Overrides conftest's: the module's app stays configured across its tests."""
    yield


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A word-level tokenizer saved like a hub checkpoint (pad 0, eos 1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "</s>", "<unk>", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>",
                                  unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} "
                         "{% endfor %}{% if add_generation_prompt %}assistant {% endif %}")
    path = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(path)
    return path


# -- verl 0.9.1 ---------------------------------------------------------------------------------

VERL_MANAGER = [
    "reward.reward_manager.source=importlib",
    "reward.reward_manager.name=QrqRewardManager",
    "reward.reward_manager.module.path=pkg://qreward_queue.integrations.verl",
    "+reward.qrq.route=judge",
]
VERL_FUNCTION = [
    "reward.custom_reward_function.path=pkg://qreward_queue.integrations.verl",
    "reward.custom_reward_function.name=compute_score",
    "+reward.custom_reward_function.reward_kwargs.route=judge",
]


def verl_config(overrides: list[str], model_path: Path):
    verl = pytest.importorskip("verl")
    from hydra import compose, initialize_config_dir

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=[
            *overrides, f"actor_rollout_ref.model.path={model_path}",
            "+ray_kwargs.ray_init.runtime_env.env_vars.QRQ_REDIS_URL=redis://host:6379/0"])


def test_verl_config_lines_resolve_to_qrq(tokenizer_dir):
    from verl.trainer.ppo.reward import get_custom_reward_fn, resolve_reward_manager_cls

    cfg = verl_config(VERL_MANAGER, tokenizer_dir)
    assert resolve_reward_manager_cls(cfg) is qrq_verl.QrqRewardManager
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.QRQ_REDIS_URL == "redis://host:6379/0"
    fn = get_custom_reward_fn(verl_config(VERL_FUNCTION, tokenizer_dir))
    assert fn.args[0] is qrq_verl.compute_score and fn.args[1] == {"route": "judge"}


def test_verl_plugin_registers_the_manager_as_qrq(tokenizer_dir):
    from verl.trainer.ppo.reward import resolve_reward_manager_cls

    cfg = verl_config(["reward.reward_manager.name=qrq", "+reward.qrq.route=judge"],
                      tokenizer_dir)
    assert resolve_reward_manager_cls(cfg) is qrq_verl.QrqRewardManager


def verl_batch(tokenizer, i: int, response: str):
    """One finished trajectory as AgentLoopWorker._compute_score builds it (left-padded prompt,
    right-padded response, dataset fields as numpy object arrays)."""
    import torch
    from verl import DataProto

    prompt_ids = [0] * 2 + tokenizer("what is 2+2?", add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [1]
    response_ids += [0] * (8 - len(response_ids))
    mask = [0, 0] + [1] * (len(prompt_ids) - 2) + [int(t != 0) for t in response_ids]
    mask[len(prompt_ids) + response_ids.index(1)] = 1
    extra = {"question": "what is 2+2?", "split": "test" if i % 3 == 0 else "train",
             "index": np.int64(i)}
    return DataProto.from_dict(
        tensors={"prompts": torch.tensor([prompt_ids]), "responses": torch.tensor([response_ids]),
                 "attention_mask": torch.tensor([mask]),
                 "input_ids": torch.tensor([prompt_ids + response_ids])},
        non_tensors={"data_source": np.array(["gsm8k"], dtype=object),
                     "reward_model": np.array([{"ground_truth": 4}], dtype=object),
                     "extra_info": np.array([extra], dtype=object),
                     "raw_prompt": np.array([[{"role": "user", "content": "what is 2+2?"}]],
                                            dtype=object),
                     "__num_turns__": np.array([np.int64(2)], dtype=object)})


@pytest.mark.parametrize("contract", ["manager", "function"])
def test_verl_reward_loop_worker_awaits_qrq_in_micro_batches(app, tokenizer_dir, contract):
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    overrides = VERL_MANAGER if contract == "manager" else VERL_FUNCTION
    worker = RewardLoopWorker(verl_config(overrides, tokenizer_dir))  # the Ray actor's class
    responses = [OK, FAIL_500, "the answer is 5"] * 22  # 66 concurrent trajectories
    batches = [verl_batch(worker.input_tokenizer, i, r) for i, r in enumerate(responses)]
    before = batcher_module.default_batcher().batches_sent

    async def agent_loops():
        return await asyncio.gather(*(worker.compute_score(b) for b in batches))

    results = worker.loop.run_until_complete(agent_loops())  # the actor's loop, as under Ray
    assert batcher_module.default_batcher().batches_sent - before <= 8  # 2 priorities x ~3
    prompt = "what is 2+2?"
    for response, result in zip(responses, results, strict=True):
        info = result["reward_extra_info"]
        if response == FAIL_500:
            assert (result["reward_score"], info["qrq_ok"]) == (FALLBACK, 0.0)
        else:
            assert result["reward_score"] == judge_score(app, make_sample(prompt, response, "4"))
            assert info["qrq_ok"] == 1.0
    # RewardLoopManager.compute_rm_score: arrays over sample 0's keys (no KeyError, no None)
    infos = [r["reward_extra_info"] for r in results]
    table = {k: np.array([info[k] for info in infos]) for k in infos[0]}
    assert set(table) >= set(qrq_verl.EXTRA_KEYS) and table["qrq_ok"].dtype == np.float64
    from verl import DataProto

    scores = qrq_verl.QrqRewardManager.assemble_rm_scores(
        DataProto.concat(batches[:3]), [r["reward_score"] for r in results[:3]])
    assert scores.sum(dim=1).tolist() == pytest.approx([r["reward_score"] for r in results[:3]])


# -- TRL 1.16.0 ---------------------------------------------------------------------------------

def tiny_model(tokenizer_dir):
    """The test tokenizer and a randomly initialised one-layer Qwen2 (no hub download)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return tok, Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=16,
                                             intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1))


def test_trl_grpo_trainer_calculates_rewards_with_qrq(app, tokenizer_dir, tmp_path):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from qreward_queue.integrations.trl import qrq_reward

    tok, model = tiny_model(tokenizer_dir)
    data = Dataset.from_dict({"prompt": ["what is 2+2?"] * 2, "solution": ["4", "4"]})
    trainer = GRPOTrainer(
        model=model, processing_class=tok, reward_funcs=[qrq_reward("judge", name="qrq")],
        train_dataset=data,
        args=GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2,
                        num_generations=2, max_completion_length=8, report_to=[],
                        use_cpu=True, logging_steps=1))
    completions = [OK, FAIL_500, "the answer is 5", OK]
    inputs = [{"prompt": "what is 2+2?", "solution": "4"} for _ in completions]
    rewards = trainer._calculate_rewards(inputs, ["what is 2+2?"] * 4, completions,
                                         [[5]] * 4)
    got = rewards[:, 0].tolist()
    assert np.isnan(got[1])  # None -> NaN: TRL leaves the sample out of the group baseline
    for i in (0, 2, 3):
        assert got[i] == pytest.approx(
            judge_score(app, make_sample("what is 2+2?", completions[i], "4")))


# -- OpenRLHF 0.11.2 ----------------------------------------------------------------------------

class FakeEngine:
    """vLLM's generate() as SingleTurnAgentExecutor uses it: .outputs[0] with token_ids."""

    def __init__(self, tokenizer, response: str):
        self.ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [1]

    async def generate(self, prompt_ids, params, multi_modal_data=None):
        out = types.SimpleNamespace(token_ids=self.ids, finish_reason="stop", logprobs=None)
        return types.SimpleNamespace(outputs=[out])


def test_openrlhf_single_turn_executor_scores_through_qrq_gateway(app, stack_dir,
                                                                   tokenizer_dir):
    pytest.importorskip("openrlhf")
    from openrlhf.utils.agent import SingleTurnAgentExecutor
    from transformers import AutoTokenizer

    _, path, stack = stack_dir
    url, _ = start_gateway(stack, path / "qrq.toml", "--host", "127.0.0.1")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    executor = SingleTurnAgentExecutor(url + "/get_reward")
    params = types.SimpleNamespace(max_tokens=8, logprobs=None)
    responses = [OK, FAIL_500, "the answer is 5"] * 4

    async def rollouts():
        return await asyncio.gather(*(
            executor.execute("what is 2+2?", "4", params, 32, tok, FakeEngine(tok, r))
            for r in responses))

    outputs = asyncio.run(rollouts())
    for response, out in zip(responses, outputs, strict=True):
        failed = response == FAIL_500
        want = FALLBACK if failed else judge_score(app, make_sample("what is 2+2?", response,
                                                                    "4"))
        assert out["reward"] == [want] and out["scores"] == [want]
        assert out["extra_logs"] == {"qrq_ok": [0.0 if failed else 1.0]}


def test_trl_grpo_trains_one_step_on_qrq_rewards(app, tokenizer_dir, tmp_path):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from qreward_queue.integrations.trl import qrq_reward

    tok, model = tiny_model(tokenizer_dir)
    trainer = GRPOTrainer(
        model=model, processing_class=tok, reward_funcs=[qrq_reward("judge", name="qrq")],
        train_dataset=Dataset.from_dict({"prompt": ["what is 2+2?"] * 4, "solution": ["4"] * 4}),
        args=GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4,
                        num_generations=2, max_completion_length=6, report_to=[],
                        use_cpu=True, logging_steps=1, save_strategy="no"))
    trainer.train()
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert "rewards/qrq/mean" in logged and "qrq/unscored_frac" in logged, logged
