"""A trainer-side batch reward function on qrq (verl's `compute_score_batch` shape).

Run it: `python examples/batch_reward_fn.py` starts a mock judge, configures qrq in embedded
mode for it, and scores a small GRPO group. In training, point verl at this function
(`custom_reward_function.path=examples/batch_reward_fn.py
custom_reward_function.name=compute_score_batch reward_model.reward_manager=batch`) and set
QRQ_CONFIG / QRQ_REDIS_URL for your deployment.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import qreward_queue as qrq


def compute_score_batch(data_sources, solution_strs, ground_truths, extra_infos, route=None,
                        **_):
    """One qrq batch per training step; every sample comes back with its status and backend."""
    samples = [
        {"prompt": (extra or {}).get("question", ""), "response": response,
         "reference": str(truth), "data_source": source}
        for source, response, truth, extra in zip(data_sources, solution_strs, ground_truths,
                                                  extra_infos, strict=True)
    ]
    split = (extra_infos[0] or {}).get("split") if extra_infos else None
    batch = qrq.submit_batch(samples, route=route, priority="val" if split == "test" else "train",
                             on_invalid="outcome")
    return [{"score": o.score, "qrq_status": o.status, "qrq_backend": o.backend}
            for o in batch.outcomes()]


def main() -> None:
    from qreward_queue.mock_judge import MockJudge, MockJudgeSettings

    with MockJudge(MockJudgeSettings(rpm=600, max_concurrent=8, latency_ms=20)) as judge:
        workers = Path(tempfile.mkdtemp()) / "workers"
        workers.mkdir()
        (workers / "judge.toml").write_text(
            f'[backend]\nkind = "judge"\nurl = "{judge.url}/v1"\nmodel = "mock"\n'
            "[limits]\nrpm = 600\nmax_concurrent = 8\n[pool]\nconcurrency = 8\n")
        (workers.parent / "qrq.toml").write_text('[defaults]\nroute = "judge"\n')
        qrq.configure(workers.parent / "qrq.toml")
        rows = compute_score_batch(
            ["demo/arith"] * 4, ["4", "5", "four", "2+2=4"], ["4"] * 4,
            [{"question": "What is 2+2?", "split": "train"}] * 4,
        )
        for row in rows:
            print(row)


if __name__ == "__main__":
    main()
