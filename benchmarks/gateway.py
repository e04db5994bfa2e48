"""The OpenAI-compatible gateway: what it adds to a request, and how it shares a judge's limit
side by side with LiteLLM's proxy.

    python benchmarks/gateway.py [--rate 100,200,500] [--seconds 6] [--clients 4] [--json]
    python benchmarks/gateway.py --side-by-side [--litellm PATH/TO/litellm] [--seconds 20]

Added latency: the mock judge (20 ms, constant, no limit) answers an open-loop load of
`--rate` requests/s (each rate of the list in turn, on one stack) for `--seconds`, sent from
`--clients` processes (one Python process cannot send 500 a second and time them fairly):
straight to it, as one-sample scores from Python (`MicroBatcher.score` in this process, the
trainer adapters' path through the queue and a `qrq worker`), and through `qrq gateway` (the
same path behind HTTP). Per path: p50/p99, and the rate answered (requests over the time from
the first send to the last answer: below the offered rate when a path cannot keep up); the
differences: what the gateway adds to qrq's own path, and what the whole path adds to a direct
call (each meaningful only while both paths `kept_up`: answered 95% of the offered rate; the
in-process path is also bounded by this one process); and the CPU the gateway process and
the worker (with its children) spent per request while the gateway's load ran, which is what
decides how many of each a rate needs.

Side by side (`--side-by-side`): the mock judge limited to `--rpm`, 4 client processes (each
`--concurrency` requests in flight, as fast as answers come) spread over 2 gateway processes
(one Redis), then over 2 LiteLLM proxy instances configured as LiteLLM's docs advise for a
limit shared across instances (the deployment's `rpm`, `routing_strategy:
usage-based-routing-v2`, Redis in `router_settings`, `enable_pre_call_checks`). Per tool: the
share of the limit the judge accepted, the judge's 429s, client latency p50/p99, requests that
failed (any non-200 a client was left with after its own retries) or were lost (no answer).
LiteLLM's proxy runs from its own virtualenv (`--litellm`): its pins clash with qrq's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from support import free_port, judge_backend, start_workers, write_config  # noqa: E402

from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn  # noqa: E402

REDIS = os.environ.get("QRQ_BENCH_REDIS_URL", "redis://127.0.0.1:6379/15")
# the proxy's master key (LiteLLM's proxy refuses to start without a strong one); the clients
# send it to both tools (an open qrq gateway ignores it)
MASTER_KEY = "sk-qrq-bench-" + "7f3a9c2e41d84b6b9e0f5a1c"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def body(i: int) -> dict:
    return {"model": "judge", "messages": [{"role": "user", "content": f"Is 2+2=4? case {i}"}],
            "max_tokens": 16}


async def open_loop(send, rate: float, seconds: float) -> dict:
    """`rate` calls of `send(i)` (True: answered) a second for `seconds`, each made at its
    time whatever came back."""
    latencies: list[float] = []
    failed = 0

    async def one(i: int) -> None:
        nonlocal failed
        started = time.perf_counter()
        if await send(i):
            latencies.append((time.perf_counter() - started) * 1000)
        else:
            failed += 1

    tasks, start, n = [], time.perf_counter(), int(rate * seconds)
    for i in range(n):
        await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    elapsed_s = time.perf_counter() - start
    return {**summary(latencies, failed, elapsed_s), "latencies": latencies,
            "elapsed_s": elapsed_s}


def summary(latencies: list[float], failed: int, elapsed_s: float) -> dict:
    return {"n": len(latencies) + failed, "failed": failed,
            "p50_ms": round(pct(latencies, 0.5), 2), "p99_ms": round(pct(latencies, 0.99), 2),
            "answered_rate": round(len(latencies) / elapsed_s, 1)}


async def over_http(url: str, rate: float, seconds: float, offset: int = 0) -> dict:
    """open_loop of chat requests POSTed to `url` (request i is `body(offset + i)`)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def send(i: int) -> bool:
            try:
                async with session.post(url, json=body(offset + i)) as resp:
                    await resp.read()
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

        return await open_loop(send, rate, seconds)


def loaded(url: str, rate: float, seconds: float, clients: int) -> dict:
    """over_http from `clients` processes at rate/clients each, started together; pooled."""
    start_at = time.time() + 3.0  # after every process has imported what it needs
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--load", url, "--rate", str(rate / clients), "--seconds",
         str(seconds), "--offset", str(k * 10_000_000), "--start-at", str(start_at)],
        stdout=subprocess.PIPE, text=True) for k in range(clients)]
    results = [json.loads(p.communicate(timeout=seconds + 300)[0]) for p in procs]
    return summary([ms for r in results for ms in r["latencies"]],
                   sum(r["failed"] for r in results), max(r["elapsed_s"] for r in results))


def load(args: argparse.Namespace) -> None:
    """One loader process of `loaded`: its raw results on stdout."""
    time.sleep(max(0.0, args.start_at - time.time()))
    print(json.dumps(asyncio.run(over_http(args.load, float(args.rate), args.seconds,
                                           args.offset))))


def cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes and their children have used so far."""
    import psutil

    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(pid)
            for p in [proc, *proc.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    times = p.cpu_times()
                    total += times.user + times.system
    return total


async def through_score_one(config: Path, rate: float, seconds: float, wait_ms: float,
                            max_in_flight: int) -> dict:
    """open_loop of one-sample scores from this process (qrq's trainer adapters' path: the
    same micro-batcher, no HTTP): what the queue and the worker take, without the gateway."""
    import qreward_queue
    from qreward_queue.trainer.batcher import MicroBatcher

    qreward_queue.configure(config)
    batcher = MicroBatcher(64, wait_ms, max_in_flight=max_in_flight or None)

    async def send(i: int) -> bool:
        outcome = await batcher.score({"prompt": f"Is 2+2=4? case {i}", "response": "4"},
                                      "judge")
        return outcome.scored

    return await open_loop(send, rate, seconds)


def start(cmd: list[str], log: Path, env: dict, ready_url: str, timeout_s: float = 120):
    fh = log.open("w")
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **env},
                            cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{cmd[:4]} did not come up:\n{log.read_text()[-2000:]}")
        with contextlib.suppress(Exception):
            import urllib.request

            urllib.request.urlopen(ready_url, timeout=1)
            return proc
        time.sleep(0.2)


def gateway(stack: contextlib.ExitStack, config: Path, directory: Path,
            wait_ms: float = 0.0, max_in_flight: int = 4) -> tuple[str, int]:
    """A gateway's URL and pid."""
    port = free_port()
    proc = start([sys.executable, "-m", "qreward_queue.cli", "gateway", "--port", str(port),
                  "--chat-max-wait-ms", str(wait_ms), "--max-in-flight", str(max_in_flight)],
                 directory / f"gateway-{port}.log", {"QRQ_CONFIG": str(config)},
                 f"http://127.0.0.1:{port}/health")
    stack.callback(lambda: (proc.terminate(), proc.wait(10)))
    return f"http://127.0.0.1:{port}", proc.pid


def qrq_stack(stack: contextlib.ExitStack, directory: Path, judge_url: str, rpm: float,
              gateways: int, wait_ms: float = 0.0, max_in_flight: int = 4
              ) -> tuple[Path, list[str], dict[str, int]]:
    """A worker and `gateways` gateways; their URLs, and the pids of the worker and the
    first gateway."""
    import redis

    redis.Redis.from_url(REDIS).flushdb()
    config = write_config(directory, {"judge": judge_backend(
        judge_url, rpm=rpm, max_concurrent=256, concurrency=8, calls=128)}, REDIS,
        route="judge", deadline_s=60)
    [worker] = start_workers(config, [("judge", "judge@bench")])
    stack.callback(worker.kill)
    urls, pids = zip(*(gateway(stack, config, directory, wait_ms, max_in_flight)
                       for _ in range(gateways)),
                     strict=True)
    return config, list(urls), {"gateway": pids[0], "worker": worker.proc.pid}


def added_latency(args: argparse.Namespace) -> list[dict]:
    rows = []
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        judge = stack.enter_context(spawn(MockJudgeSettings(latency_ms=20, latency_cv=0)))
        config, [url], pids = qrq_stack(stack, Path(tmp), judge.url, 0, 1, args.wait_ms,
                                        args.max_in_flight)
        chat = url + "/v1/chat/completions"
        loaded(chat, 100, 2.0, args.clients)  # warm up: connections, worker threads
        for rate in map(float, args.rate.split(",")):
            direct = loaded(judge.url + "/v1/chat/completions", rate, args.seconds, args.clients)
            core = asyncio.run(through_score_one(config, rate, args.seconds, args.wait_ms,
                                                 args.max_in_flight))
            core.pop("latencies"), core.pop("elapsed_s")
            before = {name: cpu_s([pid]) for name, pid in pids.items()}
            via = loaded(chat, rate, args.seconds, args.clients)
            cpu_ms = {f"{name}_cpu_ms_per_request": round(
                (cpu_s([pid]) - before[name]) * 1000 / max(1, via["n"]), 3)
                for name, pid in pids.items()}
            for path in (direct, core, via):  # else its latency is its queue's
                path["kept_up"] = path["answered_rate"] >= 0.95 * rate
            rows.append({
                "benchmark": "gateway_added_latency", "rate": rate, "seconds": args.seconds,
                "clients": args.clients, "max_wait_ms": args.wait_ms,
                "max_in_flight": args.max_in_flight,
                "direct": direct, "score_one": core, "gateway": via, **cpu_ms,
                "gateway_over_score_one_p50_ms": round(via["p50_ms"] - core["p50_ms"], 2),
                "gateway_over_score_one_p99_ms": round(via["p99_ms"] - core["p99_ms"], 2),
                "added_p50_ms": round(via["p50_ms"] - direct["p50_ms"], 2),
                "added_p99_ms": round(via["p99_ms"] - direct["p99_ms"], 2)})
    return rows


CLIENT = """
import asyncio, json, sys, time
import aiohttp
url, seconds, concurrency = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
async def main():
    out = {"ok": [], "failed": 0, "lost": 0}
    stop = time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=120)
    headers = {"Authorization": "Bearer " + sys.argv[4]}
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        async def loop(k):
            i = 0
            while time.monotonic() < stop:
                i += 1
                body = {"model": "judge", "max_tokens": 16, "messages": [
                    {"role": "user", "content": f"client {k} request {i}"}]}
                started = time.perf_counter()
                try:
                    async with session.post(url, json=body) as resp:
                        await resp.read()
                        if resp.status == 200:
                            out["ok"].append((time.perf_counter() - started) * 1000)
                        else:
                            out["failed"] += 1
                            await asyncio.sleep(1)  # a client's own backoff
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    out["lost"] += 1
        await asyncio.gather(*(loop(k) for k in range(concurrency)))
    print(json.dumps(out))
asyncio.run(main())
"""


def clients(urls: list[str], seconds: float, concurrency: int) -> dict:
    """4 client processes, spread over `urls`; their pooled results."""
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT, urls[i % len(urls)], str(seconds),
                               str(concurrency), MASTER_KEY], stdout=subprocess.PIPE, text=True)
             for i in range(4)]
    results = [json.loads(p.communicate(timeout=seconds + 180)[0]) for p in procs]
    ok = [ms for r in results for ms in r["ok"]]
    return {"ok": len(ok), "failed": sum(r["failed"] for r in results),
            "lost": sum(r["lost"] for r in results),
            "p50_ms": round(pct(ok, 0.5), 1), "p99_ms": round(pct(ok, 0.99), 1)}


def litellm_proxies(stack: contextlib.ExitStack, directory: Path, litellm: str, judge_url: str,
                    rpm: float, n: int) -> list[str]:
    import redis

    redis.Redis.from_url(REDIS).flushdb()
    config = directory / "litellm.yaml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "model_list": [{"model_name": "judge", "litellm_params": {
            "model": "openai/mock", "api_base": judge_url + "/v1", "api_key": "none",
            "rpm": int(rpm)}}],
        "router_settings": {"routing_strategy": "usage-based-routing-v2", "redis_url": REDIS,
                            "enable_pre_call_checks": True},
    }))
    urls = []
    for _ in range(n):
        port = free_port()
        proc = start([litellm, "--config", str(config), "--port", str(port)],
                     directory / f"litellm-{port}.log", {"LITELLM_LOCAL_MODEL_COST_MAP": "True",
                                                     "LITELLM_MASTER_KEY": MASTER_KEY},
                     f"http://127.0.0.1:{port}/health/liveliness", timeout_s=300)
        stack.callback(lambda p=proc: (p.terminate(), p.wait(20)))
        urls.append(f"http://127.0.0.1:{port}")
    return urls


def side_by_side(args: argparse.Namespace) -> list[dict]:
    rows = []
    tools = [("qrq gateway", None)] + ([("LiteLLM proxy", args.litellm)] if args.litellm else [])
    for tool, litellm in tools:
        with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
            judge = stack.enter_context(spawn(MockJudgeSettings(
                rpm=args.rpm, latency_ms=50, latency_cv=0.3)))
            urls = (litellm_proxies(stack, Path(tmp), litellm, judge.url, args.rpm, 2)
                    if litellm else qrq_stack(stack, Path(tmp), judge.url, args.rpm, 2)[1])
            judge.reset()
            started = time.monotonic()
            got = clients([u + "/v1/chat/completions" for u in urls], args.seconds,
                          args.concurrency)
            elapsed = time.monotonic() - started
            stats = judge.stats()
        rows.append({"benchmark": "gateway_side_by_side", "tool": tool, "rpm": args.rpm,
                     "seconds": round(elapsed, 1), **got,
                     "judge_accepted": stats["accepted"], "judge_429s": stats["rate_limited"],
                     "share_of_limit": round(stats["accepted"] / (args.rpm / 60 * elapsed), 3)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", default="500",
                        help="requests/s offered; a comma-separated list runs each in turn")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--clients", type=int, default=4, help="client processes")
    parser.add_argument("--load", help=argparse.SUPPRESS)  # a client process's target URL
    parser.add_argument("--offset", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--wait-ms", type=float, default=0.0,
                        help="the micro-batchers' longest wait (gateway: --chat-max-wait-ms)")
    parser.add_argument("--max-in-flight", type=int, default=4,
                        help="the micro-batchers' batches out at once (gateway: "
                             "--max-in-flight; 0: no limit, as before it existed)")
    parser.add_argument("--side-by-side", action="store_true")
    parser.add_argument("--litellm", help="the `litellm` executable of a litellm[proxy] venv")
    parser.add_argument("--rpm", type=float, default=600.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.load:
        return load(args)
    rows = side_by_side(args) if args.side_by_side else added_latency(args)
    for row in rows:
        print(json.dumps(row) if args.json else row)


if __name__ == "__main__":
    main()
