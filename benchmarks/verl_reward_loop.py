"""verl's real RewardLoopWorker in many processes, scoring through qrq's three documented ways.

    <trainer venv>/bin/python benchmarks/verl_reward_loop.py [--json] [--processes 8]
        [--coroutines 128] [--redis-url redis://127.0.0.1:6379/13]

Needs verl (0.9.x): `bash .ci/trainers.sh` builds the venv that has it
(~/.cache/qrq/venv-trainers); elsewhere the script says so and exits 0 without running.

Each of `processes` spawned processes builds verl's `RewardLoopWorker` (the Ray actor's class)
from verl's own config composed with the docs' lines for one entry point, and awaits
`coroutines` concurrent `worker.compute_score(trajectory)` on the worker's own event loop, as
verl's agent loop does (one trajectory per call, a word-level tokenizer built in-process):
  manager   reward.reward_manager.source=importlib, name=QrqRewardManager, module.path=...
  plugin    reward.reward_manager.name=qrq (verl's plugin loader finds qrq's entry point)
  function  reward.custom_reward_function.path=..., name=compute_score
The judge (S1: 3000 rpm, 64 in flight, 200 ms), the 2 `qrq worker`s and the columns are
trainer_agent_loop.py's; `<entry>_light` rows: 4 callers each awaiting one trajectory at a
time (the judge not saturated), against `judge_light` (the same calls straight to the judge).
JSON lines add `client_cpu_ms_per_sample` (the trainer processes' CPU over the scoring).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    BACKEND,
    SampleResult,
    flush_redis,
    judge_config,
    run_scenarios,
    start_qrq_workers,
    write_config,
)
from trainer_agent_loop import (
    LIGHT_CALLERS,
    LIGHT_SAMPLES,
    SERVER_CONCURRENT,
    SERVER_RPM,
    WORKER_THREADS,
    WORKERS,
    log,
    run_client,
    verl_rows,
)

import qreward_queue
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn
from qreward_queue.trainer.batcher import default_batcher

ENTRY_POINTS = {
    "manager": ["reward.reward_manager.source=importlib",
                "reward.reward_manager.name=QrqRewardManager",
                "reward.reward_manager.module.path=pkg://qreward_queue.integrations.verl",
                f"+reward.qrq.route={BACKEND}"],
    "plugin": ["reward.reward_manager.name=qrq", f"+reward.qrq.route={BACKEND}"],
    "function": ["reward.custom_reward_function.path=pkg://qreward_queue.integrations.verl",
                 "reward.custom_reward_function.name=compute_score",
                 f"+reward.custom_reward_function.reward_kwargs.route={BACKEND}"],
}


def plain_rows(n: int) -> list[dict]:
    """verl_rows with single-spaced texts: what the word-level tokenizer decodes them back to."""
    rows = verl_rows(n)
    for row in rows:
        row["solution_str"] = " ".join(row["solution_str"].split())
        row["extra_info"] = {"question": " ".join(row["extra_info"]["question"].split())}
    return rows


def tokenizer_dir(rows: list[dict], where: Path) -> Path:
    """A word-level tokenizer over the rows' words, saved like a checkpoint (pad 0, eos 1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for r in rows for text in (r["extra_info"]["question"], r["solution_str"])
                    for w in text.split()} | {"user", "assistant"})
    vocab = {w: i for i, w in enumerate(["<pad>", "</s>", "<unk>", *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>",
                                  unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} "
                         "{% endfor %}{% if add_generation_prompt %}assistant {% endif %}")
    tok.save_pretrained(where)
    return where


def reward_loop_worker(entry: str, model_path: Path):
    """verl's RewardLoopWorker from verl's config and the docs' lines for `entry`."""
    import verl
    from hydra import compose, initialize_config_dir
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose("ppo_trainer", overrides=[
            *ENTRY_POINTS[entry], f"actor_rollout_ref.model.path={model_path}"])
    return RewardLoopWorker(config)


def trajectory(tokenizer, row: dict):
    """One finished trajectory as verl's agent loop hands it to the reward loop."""
    import numpy as np
    import torch
    from verl import DataProto

    question = row["extra_info"]["question"]
    prompt_ids = tokenizer(question, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(row["solution_str"], add_special_tokens=False)["input_ids"] + [1]
    return DataProto.from_dict(
        tensors={"prompts": torch.tensor([prompt_ids]), "responses": torch.tensor([response_ids]),
                 "attention_mask": torch.tensor([[1] * (len(prompt_ids) + len(response_ids))]),
                 "input_ids": torch.tensor([prompt_ids + response_ids])},
        non_tensors={
            "data_source": np.array([row["data_source"]], dtype=object),
            "reward_model": np.array([{"ground_truth": row["ground_truth"]}], dtype=object),
            "extra_info": np.array([row["extra_info"]], dtype=object),
            "raw_prompt": np.array([[{"role": "user", "content": question}]], dtype=object),
            "__num_turns__": np.array([np.int64(2)], dtype=object)})


def _verl_trainer(kind: str, config_path: str, rows: list[dict], barrier, queue,
                  index: int) -> None:
    """One of verl's reward processes: get ready, wait for the others, score, report."""
    started = time.time()
    try:
        os.environ["QRQ_CONFIG"] = config_path  # what Ray's runtime_env sets
        qreward_queue.configure(qreward_queue.load_config(config_path))
        entry, light = kind.removesuffix("_light"), kind.endswith("_light")
        with tempfile.TemporaryDirectory() as tmp:
            worker = reward_loop_worker(entry, tokenizer_dir(rows, Path(tmp)))
        batches = [trajectory(worker.input_tokenizer, r) for r in rows]
        timed: list = [None] * len(rows)

        async def one_by_one(part: list[int]) -> None:
            for i in part:
                begun = time.perf_counter()
                timed[i] = (await worker.compute_score(batches[i]),
                            (time.perf_counter() - begun) * 1000)

        async def agent_loop() -> None:
            parts = ([list(range(k, len(rows), LIGHT_CALLERS)) for k in range(LIGHT_CALLERS)]
                     if light else [[i] for i in range(len(rows))])
            await asyncio.gather(*map(one_by_one, parts))

        barrier.wait()
        started, cpu0 = time.time(), time.process_time()
        worker.loop.run_until_complete(agent_loop())  # the actor's loop, as under Ray
        cpu = time.process_time() - cpu0
        results = []
        for result, ms in timed:
            ok = result["reward_extra_info"]["qrq_ok"] == 1.0
            results.append(SampleResult(result["reward_score"], ok, ms if light else 0.0, not ok))
    except Exception as exc:  # report it: the parent must not wait for a dead trainer
        barrier.abort()
        queue.put((index, started, time.time(), None, f"{type(exc).__name__}: {exc}", 0))
        return
    queue.put((index, started, time.time(), [tuple(vars(r).values()) for r in results], cpu,
               default_batcher().batches_sent))


def scenario(args):
    rows = plain_rows(args.processes * args.coroutines)
    flush_redis(args.redis_url)
    runs = []
    with tempfile.TemporaryDirectory(prefix="qrq-bench-") as tmp, spawn(
        MockJudgeSettings(rpm=SERVER_RPM, max_concurrent=SERVER_CONCURRENT, latency_ms=200.0,
                          latency_cv=0.5)) as mock:
        config_path = write_config(Path(tmp), {BACKEND: judge_config(
            mock.url, rpm=SERVER_RPM, max_concurrent=SERVER_CONCURRENT,
            calls=WORKER_THREADS)}, redis_url=args.redis_url, deadline_s=600)
        config = qreward_queue.load_config(config_path)
        app = qreward_queue.configure(config)
        log(f"starting {WORKERS} qrq workers x {WORKER_THREADS} threads")
        workers = start_qrq_workers(config_path,
                                    [(BACKEND, f"w{i + 1}") for i in range(WORKERS)], app)
        env = {"mock": mock, "config_path": config_path, "config": config, "workers": workers}
        try:
            for entry in ENTRY_POINTS:
                log(f"{entry}: {len(rows)} trajectories from {args.processes} processes")
                runs.append(run_client(env, entry, rows, args.processes, _verl_trainer))
                log(f"{entry}_light: {LIGHT_CALLERS} callers, one trajectory at a time")
                runs.append(run_client(env, f"{entry}_light", rows[:LIGHT_SAMPLES], 1,
                                       _verl_trainer))
        finally:
            for w in workers:
                w.stop()
        env["workers"] = []
        log(f"judge_light: {LIGHT_CALLERS} direct callers, one sample at a time")
        runs.append(run_client(env, "judge_light", rows[:LIGHT_SAMPLES], 1))
    notes = [f"{r.client}: client CPU {r.extra['client_cpu_ms_per_sample']} ms/sample, "
             f"{r.extra['groups']} groups, {r.extra['lost']} lost" for r in runs]
    return runs, notes


def targets(runs):
    by = {r.client: r for r in runs}
    judge, out = by.get("judge_light"), []
    for entry in ENTRY_POINTS:
        r, light = by.get(entry), by.get(f"{entry}_light")
        if r is None:
            continue
        cpu = r.extra["client_cpu_ms_per_sample"]
        out += [(f"{entry}: throughput >= 100% of the limit", r.fraction_of_limit >= 1.0,
                 f"{r.fraction_of_limit:.1%}"),
                (f"{entry}: client CPU <= 3 ms per sample", cpu <= 3.0, f"{cpu} ms"),
                (f"{entry}: 0 wrong, 0 lost", r.wrong == 0 and r.extra["lost"] == 0,
                 f"wrong {r.wrong}, lost {r.extra['lost']}")]
        if light is not None and judge is not None and light.p50_ms and judge.p50_ms:
            ratio = light.p50_ms / judge.p50_ms
            out.append((f"{entry}: caller p50 <= 1.3x the judge's p50 (not saturated)",
                        ratio <= 1.3, f"{light.p50_ms:.0f} / {judge.p50_ms:.0f} ms = "
                                      f"{ratio:.2f}x"))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="also one JSON line per run")
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--coroutines", type=int, default=128)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/13")
    args = parser.parse_args(argv)
    try:
        import verl  # noqa: F401
    except ImportError:
        print("verl is not installed in this Python: skipped. `bash .ci/trainers.sh` builds a "
              "venv with verl 0.9.1 (~/.cache/qrq/venv-trainers); run this script with its "
              "python.")
        return
    args.scenario = "verl_reward_loop"
    print(f"qrq in verl's RewardLoopWorker: {args.processes} processes x {args.coroutines} "
          f"coroutines, Redis at {args.redis_url} (flushed), judge 3000 rpm / 64 / 200 ms")
    run_scenarios({"verl_reward_loop": ("verl's reward loop, three entry points", scenario)},
                  args, targets)


if __name__ == "__main__":
    main()
