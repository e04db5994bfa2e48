"""Group judging vs per-sample judging under the same TPM-bound judge: judge calls, tokens sent
and samples/s, each as a ratio in the same run.

    python benchmarks/group_judging.py [--groups 128] [--size 8] [--tpm 1200000] [--json]

One mock judge (a subprocess; latency 200 ms, cv 0.3; --tpm tokens per minute, no rpm limit)
scores a GRPO batch of `groups` x `size` samples twice:

per-sample (qrq)  the batch through `submit_batch` and one real `qrq worker` (32 calls in
                  flight, the backend file knowing the TPM): one chat call per sample, the
                  default judge template, max_tokens 16.
group (qrq)       the same batch, worker and limits, the backend file saying `mode = "group"`
                  (group_max = the group size): one chat call per group with the default group
                  template (the prompt once, the responses numbered), max_tokens 12 per
                  response, the reply parsed into one score per response.

`calls` = the judge's accepted calls, `429` its refusals, `prompt_tok` / `completion_tok` the
usage it billed, `samples/s` = samples over the wall time of the side. `wrong` = scores that
disagree with the mock's rule (verdict of the message per sample; rm_verdict(head, response)
per response of a group). Redis: $QRQ_BENCH_REDIS_URL (default database 9), flushed first.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REDIS_URL, QrqWorker, flush_redis, write_config

import qreward_queue
from qreward_queue.backends import make_backend
from qreward_queue.backends.groups import DEFAULT_GROUP_TEMPLATE, render_group
from qreward_queue.config.model import DEFAULT_TEMPLATE
from qreward_queue.testing.mock_judge import (
    MockJudgeSettings,
    rm_verdict,
    spawn,
    split_group,
    verdict,
)

BACKEND = "judge"
CALLS = 32
RUBRIC = ("Solve the problem and show your reasoning; the final answer goes in \\boxed{}. "
          "A correct answer with sound steps is worth more than a lucky guess. ") * 4


def grpo_batch(groups: int, size: int) -> list[dict]:
    """`groups` prompts of ~700 characters, `size` distinct responses of ~300 each."""
    return [
        {"prompt": f"{RUBRIC}Problem {g}: what is {g} x {g + 7}?",
         "response": f"Response {r} to problem {g}. " + f"Step {r}: multiply and carry. " * 9
                     + f"\\boxed{{{g * (g + 7) + r % 3}}}"}
        for g in range(groups) for r in range(size)
    ]


def through_qrq(judge_url: str, samples: list[dict], tpm: float, mode: str, size: int
                ) -> dict:
    """The batch through one real worker of a judge in `mode`; wall time, outcomes off."""
    flush_redis(REDIS_URL)
    grouped = {"mode": "group", "group_max": size, "max_tokens": 12} if mode == "group" else {}
    backend = {
        "backend": {"kind": "judge", "url": judge_url + "/v1", "model": "mock", "timeout_s": 30,
                    **grouped},
        "limits": {"tpm": tpm},
        "pool": {"type": "threads", "concurrency": 2, "calls": CALLS},
        "retry": {"attempts": 5, "backoff_base_s": 0.1, "backoff_cap_s": 1.0},
    }
    with tempfile.TemporaryDirectory(prefix="qrq-group-bench-") as tmp:
        config = write_config(Path(tmp), {BACKEND: backend}, redis_url=REDIS_URL)
        app = qreward_queue.configure(qreward_queue.load_config(config))
        worker = QrqWorker(config, BACKEND, mode, app)
        try:
            started = time.perf_counter()
            outcomes = qreward_queue.submit_batch(samples, route=BACKEND, app=app).outcomes()
            wall = time.perf_counter() - started
        finally:
            worker.stop()
    want = expected(app.backend_config(BACKEND), samples)
    return {"wall_s": wall, "not_ok": sum(not o.scored for o in outcomes),
            "wrong": sum(o.scored and o.score != w for o, w in zip(outcomes, want, strict=True))}


def expected(config, samples: list[dict]) -> list[float]:
    """The mock's score of each sample: of its message, or of its response in its group."""
    if config.options.mode != "group":
        return [verdict(DEFAULT_TEMPLATE.format(prompt=s["prompt"], response=s["response"],
                                                reference="")) for s in samples]
    scores = [0.0] * len(samples)
    for call in make_backend(config).split(samples):
        head, responses = split_group(render_group(DEFAULT_GROUP_TEMPLATE,
                                                   [samples[i] for i in call]))
        for i, response in zip(call, responses, strict=True):
            scores[i] = rm_verdict(head, response)
    return scores


def run_side(mode: str, judge, n: int, run) -> dict:
    judge.reset()
    figures = run()
    stats = judge.stats()
    return {"mode": mode, "samples": n, "calls": stats["accepted"],
            "rate_limited": stats["rate_limited"], "prompt_tokens": stats["prompt_tokens"],
            "completion_tokens": stats["completion_tokens"],
            "samples_per_s": round(n / figures["wall_s"], 1),
            **figures, "wall_s": round(figures["wall_s"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=128)
    parser.add_argument("--size", type=int, default=8)
    parser.add_argument("--tpm", type=float, default=1_200_000)
    parser.add_argument("--json", action="store_true", help="One JSON line per side and ratios.")
    args = parser.parse_args()
    samples = grpo_batch(args.groups, args.size)
    n = len(samples)
    settings = MockJudgeSettings(tpm=args.tpm, latency_ms=200, latency_cv=0.3)
    with spawn(settings) as judge:
        sides = [
            run_side("per-sample (qrq)", judge, n,
                     lambda: through_qrq(judge.url, samples, args.tpm, "sample", args.size)),
            run_side("group (qrq)", judge, n,
                     lambda: through_qrq(judge.url, samples, args.tpm, "group", args.size)),
        ]
    base, group = sides
    ratios = {"mode": "ratio group/per-sample"} | {
        key: round(group[key] / base[key], 3) if base[key] else None
        for key in ("calls", "prompt_tokens", "completion_tokens", "samples_per_s")
    }
    print(f"{args.groups} groups x {args.size} responses = {n} samples, judge TPM "
          f"{args.tpm:,.0f}, latency 200 ms (machine shared: read the ratios)")
    header = (f"{'mode':<24}{'calls':>7}{'429':>6}{'prompt_tok':>12}{'completion_tok':>16}"
              f"{'samples/s':>11}{'wall_s':>8}{'not_ok':>8}{'wrong':>7}")
    print(header + "\n" + "-" * len(header))
    for s in sides:
        print(f"{s['mode']:<24}{s['calls']:>7}{s['rate_limited']:>6}{s['prompt_tokens']:>12}"
              f"{s['completion_tokens']:>16}{s['samples_per_s']:>11}{s['wall_s']:>8}"
              f"{s['not_ok']:>8}{s['wrong']:>7}")
    print(f"{ratios['mode']:<24}{ratios['calls']:>7}{'':>6}{ratios['prompt_tokens']:>12}"
          f"{ratios['completion_tokens']:>16}{ratios['samples_per_s']:>11}")
    if args.json:
        for line in (*sides, ratios):
            print(json.dumps(line))


if __name__ == "__main__":
    main()
