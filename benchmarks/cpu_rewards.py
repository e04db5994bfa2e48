"""CPU rewards through qrq vs multiprocessing.Pool(cores) vs a plain loop: format, math, code.

For each reward: N samples through qrq (distributed: a real prefork `qrq worker`,
concurrency = cores, Redis), through `multiprocessing.Pool(cores).map` in-process, and through
a plain loop on one core. Prints samples/s, the ratio to the pool, the time `submit_batch`
took to enqueue, wrong scores (against the loop), and for code the p50/p99 per sample and the
sandbox's own overhead per program (an empty program, against a bare interpreter start).
Both qrq's worker and the pool are warmed up (imports, helper processes) before the clock
starts.

    python benchmarks/cpu_rewards.py --redis-url redis://127.0.0.1:6379/14 --json
    python benchmarks/cpu_rewards.py --reward code --n 256     # a quick run
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import QrqWorker, flush_redis, percentile, process_tree_cpu_s, write_config

import qreward_queue
from qreward_queue.backends.function_runner import load_function

CORES = os.cpu_count() or 2
REWARDS = {
    "format": ("qreward_queue.rewards.format:format_reward", 512, {}),
    "math": ("qreward_queue.rewards.math:math_reward", 64, {}),
    "code": ("qreward_queue.rewards.code:code_reward", 1, {"time_s": 10, "case_s": 1}),
}
CODE_TIMEOUT_S = 25  # per sample: >= time_s + (2 case_s + 1) + the sandbox's 10 s grace + 1 s


def format_samples(n: int, rng: random.Random) -> list[dict]:
    words = [
        "so",
        "the",
        "answer",
        "is",
        "then",
        "we",
        "add",
        "step",
        "check",
        "number",
        "value",
        "total",
    ]
    out = []
    for i in range(n):
        think = " ".join(rng.choice(words) for _ in range(rng.randint(60, 140)))
        response = f"<think>\n{think}\n</think>\n<answer>{i}</answer>"
        if i % 3 == 2:
            response = response.replace("</think>", "")  # a third break the format
        out.append({"prompt": f"q{i}", "response": response})
    return out


def equivalent(a: int) -> tuple[str, str]:
    """(response answer, reference) that only math-verify sees are equal, different per a."""
    return [
        (f"\\frac{{{a}\\sqrt{{2}}}}{{2}}", f"\\frac{{{a}}}{{\\sqrt{{2}}}}"),
        (f"(x+{a})^2", f"x^2+{2 * a}x+{a * a}"),
        (f"{a}\\sqrt{{2}}", f"\\sqrt{{{2 * a * a}}}"),
        (f"\\{{{a},{a + 1}\\}}", f"\\{{{a + 1},{a}\\}}"),
    ][a % 4]


def math_samples(n: int, rng: random.Random) -> list[dict]:
    out = []
    for i in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        kind = i % 3
        if kind == 0:  # right, plain number: the fast path
            answer, reference = str(a * b), f"{a} * {b} = {a * b}\n#### {a * b}"
        elif kind == 1:  # right, but only math-verify sees it
            answer, reference = equivalent(a)
        else:  # wrong: math-verify has the last word
            answer, reference = f"\\frac{{{a}}}{{{b}}}", f"\\frac{{{b}}}{{{a + 1}}}"
        response = f"Let us compute. {a} and {b} give the result.\nSo \\boxed{{{answer}}}."
        out.append({"prompt": f"q{i}", "response": response, "reference": reference})
    return out


CODE_BANK = [  # (right program, wrong program, make one (input, output) case from rng)
    (
        "a, b = map(int, input().split())\nprint(a + b)",
        "a, b = map(int, input().split())\nprint(a - b)",
        lambda r: (lambda a, b: (f"{a} {b}\n", f"{a + b}\n"))(r.randint(0, 99), r.randint(1, 99)),
    ),
    (
        "s = input().strip()\nprint(s[::-1])",
        "s = input().strip()\nprint(s)",
        lambda r: (lambda s: (s + "\n", s[::-1] + "\n"))(
            "".join(r.choice("abcdef") for _ in range(8))
        ),
    ),
    (
        "n = int(input())\nnums = list(map(int, input().split()))\nprint(*sorted(nums))",
        "n = int(input())\nnums = list(map(int, input().split()))\nprint(*nums)",
        lambda r: (
            lambda xs: (
                f"{len(xs)}\n{' '.join(map(str, xs))}\n",
                " ".join(map(str, sorted(xs))) + "\n",
            )
        )([r.randint(0, 50) for _ in range(6)]),
    ),
    (
        "n = int(input())\nbest = cur = 0\nfor x in map(int, input().split()):\n"
        "    cur = max(x, cur + x)\n    best = max(best, cur)\nprint(best)",
        "n = int(input())\nprint(max(map(int, input().split())))",
        lambda r: (lambda xs: (f"{len(xs)}\n{' '.join(map(str, xs))}\n", f"{_kadane(xs)}\n"))(
            [r.randint(-9, 9) for _ in range(8)]
        ),
    ),
]
HANG = "import sys\ndata = sys.stdin.read()\nwhile True:\n    pass"
CRASH = "x = int(input())\nprint(1 / 0)"


def _kadane(xs: list[int]) -> int:
    best = cur = 0
    for x in xs:
        cur = max(x, cur + x)
        best = max(best, cur)
    return best


def code_samples(n: int, rng: random.Random) -> list[dict]:
    out = []
    for i in range(n):
        right, wrong, make = CODE_BANK[i % len(CODE_BANK)]
        cases = [make(rng) for _ in range(rng.randint(5, 10))]
        roll = i % 30
        program = (
            HANG
            if roll == 29
            else CRASH
            if roll in (27, 28)
            else (wrong if roll % 3 == 1 else right)
        )  # 1 in 30 hangs, 2 in 30 crash, a third of the rest are wrong
        response = f"Here is my solution:\n```python\n{program}\n```"
        tests = [{"input": a, "output": b} for a, b in cases]
        out.append({"prompt": f"task {i}", "response": response, "extra": {"tests": tests}})
    return out


MAKERS = {"format": format_samples, "math": math_samples, "code": code_samples}


def call_timed(item: tuple[str, dict, dict]) -> tuple[float | None, float, str]:
    """Score one sample in a baseline: (score or None, seconds, status)."""
    path, options, sample = item
    started = time.perf_counter()
    try:
        score, status = float(load_function(path)(sample, **options)), "ok"
    except Exception as exc:
        score, status = None, "timeout" if type(exc).__name__ == "SampleTimeout" else "error"
    return score, time.perf_counter() - started, status


def run_loop(path: str, options: dict, samples: list[dict], warm: list[dict]) -> dict:
    for s in warm:
        call_timed((path, options, s))
    started = time.perf_counter()
    results = [call_timed((path, options, s)) for s in samples]
    return summary("loop (1 core)", time.perf_counter() - started, results)


def run_pool(path: str, options: dict, samples: list[dict], warm: list[dict]) -> dict:
    with multiprocessing.get_context("fork").Pool(CORES) as pool:
        pool.map(call_timed, [(path, options, s) for s in warm], chunksize=1)
        cpu, started = process_tree_cpu_s(os.getpid()), time.perf_counter()
        chunk = max(1, len(samples) // (CORES * 8))
        results = pool.map(call_timed, [(path, options, s) for s in samples], chunksize=chunk)
        wall = time.perf_counter() - started
        cpu = process_tree_cpu_s(os.getpid()) - cpu
    out = summary(f"multiprocessing.Pool({CORES})", wall, results)
    out["cores_used"] = round(cpu / wall, 2)
    return out


def run_qrq(reward: str, samples: list[dict], redis_url: str, chunk: int, warm: list[dict]) -> dict:
    path, _, options = REWARDS[reward]
    flush_redis(redis_url)
    with tempfile.TemporaryDirectory(prefix="qrq-cpu-bench-") as tmp:
        backend = {
            "backend": {
                "kind": "function",
                "function": path,
                "chunk_size": chunk,
                "timeout_s": CODE_TIMEOUT_S,
                "options": options,
            },
            "pool": {"type": "prefork", "concurrency": CORES},
        }
        config = write_config(Path(tmp), {reward: backend}, redis_url=redis_url, deadline_s=3600)
        app = qreward_queue.configure(qreward_queue.load_config(config))
        worker = QrqWorker(config, reward, reward, app)
        try:
            qreward_queue.submit_batch(warm, route=reward, app=app).get(timeout=600)
            cpu, started = worker.cpu_s() + time.process_time(), time.perf_counter()
            batch = qreward_queue.submit_batch(samples, route=reward, app=app)
            enqueued = time.perf_counter() - started
            outcomes = batch.outcomes(timeout=3600)
            wall = time.perf_counter() - started
            cpu = worker.cpu_s() + time.process_time() - cpu
        finally:
            worker.stop()
    results = [
        (o.score if o.status == "ok" else None, (o.latency_ms or 0) / 1000 / chunk, o.status)
        for o in outcomes
    ]
    out = summary(f"qrq (prefork x{CORES}, chunk {chunk})", wall, results)
    out["enqueue_s"] = round(enqueued, 4)
    out["cores_used"] = round(cpu / wall, 2)  # the worker's processes and this client
    return out


def summary(client: str, wall: float, results: list[tuple]) -> dict:
    seconds = [r[1] for r in results]
    statuses: dict[str, int] = {}
    for r in results:
        statuses[r[2]] = statuses.get(r[2], 0) + 1
    hung = [r[1] for r in results if r[2] == "timeout"]
    return {
        "client": client,
        "timeouts": len(hung),
        "timeout_max_ms": round(1000 * max(hung), 1) if hung else None,
        "n": len(results),
        "wall_s": round(wall, 3),
        "per_s": round(len(results) / wall, 1),
        "p50_ms": round(1000 * percentile(seconds, 50), 1),
        "p99_ms": round(1000 * percentile(seconds, 99), 1),
        "max_ms": round(1000 * max(seconds), 1),
        "statuses": statuses,
        "scores": [r[0] for r in results],
    }


def bench(reward: str, n: int, redis_url: str, loop_n: int) -> list[dict]:
    path, chunk, options = REWARDS[reward]
    samples = MAKERS[reward](n, random.Random(7))
    # every client warms up on the same other samples (so no cache of a parser helps later)
    warm = MAKERS[reward](min(n, max(64, chunk * CORES * 2)), random.Random(99))
    # the pool first: its processes fork from this one, which must not have scored `samples`
    pool = run_pool(path, options, samples, warm)
    qrq = run_qrq(reward, samples, redis_url, chunk, warm)
    loop = run_loop(path, options, samples[:loop_n], warm)
    reference = pool["scores"]
    for run in (loop, pool, qrq):
        run["reward"] = reward
        run["ratio_to_pool"] = round(run["per_s"] / pool["per_s"], 3)
        scores = run.pop("scores")
        run["wrong"] = sum(a != b for a, b in zip(scores, reference[: len(scores)], strict=True))
    if chunk > 1:
        qrq["note"] = "qrq p50/p99: task latency / chunk size"
    return [qrq, pool, loop]


def sandbox_overhead(n: int) -> dict:
    """The sandbox's own cost per program: an empty program with one empty case, one run at a
    time, against starting a bare interpreter (`python -I -S -c pass`) in the same run."""
    from qreward_queue.rewards import sandbox

    mechanism = sandbox.pick_mechanism()
    runs, bare = [], []
    for _ in range(n):
        started = time.perf_counter()
        sandbox.run_cases("", [{"input": ""}])
        runs.append(time.perf_counter() - started)
        started = time.perf_counter()
        subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], check=True)
        bare.append(time.perf_counter() - started)
    return {
        "client": f"sandbox overhead ({mechanism}): empty program, 1 case",
        "n": n,
        "p50_ms": round(1000 * percentile(runs, 50), 1),
        "p99_ms": round(1000 * percentile(runs, 99), 1),
        "bare_interpreter_p50_ms": round(1000 * percentile(bare, 50), 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reward", default="all", choices=[*REWARDS, "all"])
    parser.add_argument("--n", type=int, default=8192, help="samples per reward (format, math)")
    parser.add_argument("--code-n", type=int, default=1024, help="samples for code")
    parser.add_argument("--loop-n", type=int, default=1024, help="samples for the plain loop")
    parser.add_argument(
        "--redis-url", default=os.environ.get("QRQ_BENCH_REDIS_URL", "redis://127.0.0.1:6379/9")
    )
    parser.add_argument(
        "--overhead-n", type=int, default=100, help="empty programs timed for the overhead"
    )
    parser.add_argument("--json", action="store_true", help="also one JSON line per run")
    args = parser.parse_args(argv)
    rewards = list(REWARDS) if args.reward == "all" else [args.reward]
    print(
        f"{'reward':7} {'client':32} {'n':>5} {'wall_s':>7} {'per_s':>8} {'x pool':>7} "
        f"{'enqueue_s':>9} {'p50_ms':>7} {'p99_ms':>7} {'wrong':>5} {'hang_max_s':>10} "
        f"{'cores':>5} statuses"
    )
    for reward in rewards:
        n = args.code_n if reward == "code" else args.n
        for run in bench(reward, n, args.redis_url, min(args.loop_n, n)):
            worst = run["timeout_max_ms"]
            hang = "-" if worst is None else f"{worst / 1000:.2f}"
            report(run, args.json,
                   f"{reward:7} {run['client']:32} {run['n']:5d} {run['wall_s']:7.2f} "
                   f"{run['per_s']:8.1f} {run['ratio_to_pool']:7.2f} "
                   f"{run.get('enqueue_s', float('nan')):9.3f} {run['p50_ms']:7.1f} "
                   f"{run['p99_ms']:7.1f} {run['wrong']:5d} {hang:>10} "
                   f"{run.get('cores_used', float('nan')):5.2f} {run['statuses']}")
        if reward == "code":
            run = sandbox_overhead(args.overhead_n)
            report(run, args.json,
                   f"{reward:7} {run['client']:32} {run['n']:5d} p50 {run['p50_ms']:.1f} ms, "
                   f"p99 {run['p99_ms']:.1f} ms (a bare interpreter start: p50 "
                   f"{run['bare_interpreter_p50_ms']:.1f} ms)")


def report(run: dict, as_json: bool, line: str) -> None:
    """One table line, and the run as a JSON line with --json."""
    print(line, flush=True)
    if as_json:
        print(json.dumps(run), flush=True)


if __name__ == "__main__":
    main()
