"""Which HTTP client for the worker's calls: CPU per call against the mock judge, same run.

    python benchmarks/http_clients.py [--n 4000] [--threads 48] [--modes plain,tls,proxy]
                                      [--json]

The mock judge (20 ms mean latency, cv 0.5, no binding limit) runs in its own process; each
client makes `--n` judge calls from this process and the script prints calls/s and this
process's CPU per call (user + system), with the ratio to the asyncio + aiohttp client doing
the same. Modes: `plain` HTTP; `tls`, HTTPS with a certificate from a throwaway CA (trusted as
`ca_file`, as aiohttp's ssl context); `proxy`, that HTTPS through a CONNECT proxy in its own
process (the backend's `proxy`, aiohttp's `proxy=`).

  aiohttp          asyncio + aiohttp, Semaphore(64), one event loop (baselines.async_semaphore)
  urllib3          `--threads` threads sharing one urllib3 PoolManager (qrq's client until now)
  qrq post_json    `--threads` threads through qreward_queue.backends.transport.post_json
                   (one keep-alive socket per thread: the call pool, under a limiter)
  qrq call loop    post_json_async on the worker's call loop, Semaphore(64) (one asyncio
                   thread: a backend with no limiter)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import ssl
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import baselines
from throughput import LATENCY_CV, LATENCY_MS, samples_for

from qreward_queue.backends import JudgeOptions
from qreward_queue.backends.transport import post_json, post_json_async
from qreward_queue.config.model import Backend
from qreward_queue.testing.certs import Certs, make_certs
from qreward_queue.testing.connect_proxy import spawn_proxy
from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn
from qreward_queue.worker.call_loop import call_loop


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def urllib3_post(threads: int):
    import urllib3

    pool = urllib3.PoolManager(maxsize=threads, retries=False)

    def post(url: str, payload: dict) -> dict:
        resp = pool.request("POST", url, body=json.dumps(payload).encode(),
                            headers={"Content-Type": "application/json"}, redirect=False)
        return json.loads(resp.data)

    return post


def measure(name: str, n: int, run) -> dict:
    before, started = cpu_s(), time.perf_counter()
    run()
    wall, cpu = time.perf_counter() - started, cpu_s() - before
    return {"client": name, "n": n, "per_s": n / wall, "cpu_ms_per_call": 1000 * cpu / n}


MODES = ("plain", "tls", "proxy")


def run_mode(mode: str, args, certs: Certs | None) -> list[dict]:
    """The clients' rows against a judge served `mode`'s way: plain HTTP, HTTPS (a throwaway
    CA) or HTTPS through a CONNECT proxy (its own process)."""
    tls = mode != "plain"
    settings = MockJudgeSettings(latency_ms=LATENCY_MS, latency_cv=LATENCY_CV,
                                 tls_cert=str(certs.cert) if tls and certs else "",
                                 tls_key=str(certs.key) if tls and certs else "")
    with contextlib.ExitStack() as stack:
        judge = stack.enter_context(spawn(settings, timeout_s=60))  # a loaded machine
        proxy = stack.enter_context(spawn_proxy()).url if mode == "proxy" else None
        backend = Backend(name=f"judge-{mode}", kind="judge", timeout_s=10,
                          options=JudgeOptions(url=judge.url + "/v1", model="mock",
                          proxy=proxy or "", ca_file=str(certs.ca) if tls and certs else None))
        backend = replace(backend, pool=replace(backend.pool, calls=args.threads))
        request = baselines._Request(backend)
        payloads = [request.payload(s) for s in samples_for(args.n)]
        context = ssl.create_default_context(cafile=str(certs.ca)) if tls and certs else None

        def aiohttp_calls(n: int) -> None:
            baselines.async_semaphore(backend, samples_for(n), 64, context, proxy)

        async def on_loop(payloads: list[dict]) -> None:
            gate = asyncio.Semaphore(64)

            async def one(payload: dict) -> None:
                async with gate:
                    await post_json_async(backend, request.endpoint, payload)

            await asyncio.gather(*(one(p) for p in payloads))

        def threaded(post) -> None:
            with ThreadPoolExecutor(args.threads) as pool:
                list(pool.map(lambda p: post(request.endpoint, p), payloads))

        aiohttp_calls(200)  # warm: imports, connections
        call_loop().run(on_loop(payloads[:200]), None)
        rows = [measure("aiohttp", args.n, lambda: aiohttp_calls(args.n))]
        if mode == "plain":
            rows.append(measure("urllib3", args.n, lambda: threaded(urllib3_post(args.threads))))
        rows += [
            measure("qrq post_json", args.n,
                    lambda: threaded(lambda url, p: post_json(backend, url, p).body)),
            measure("qrq call loop", args.n, lambda: call_loop().run(on_loop(payloads), None)),
        ]
    for row in rows:
        row["mode"] = mode
        row["cpu_vs_aiohttp"] = row["cpu_ms_per_call"] / rows[0]["cpu_ms_per_call"]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=4000)
    parser.add_argument("--threads", type=int, default=48)
    parser.add_argument("--modes", default="plain",
                        help=f"comma-separated, of {', '.join(MODES)} (default: plain)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        certs = make_certs(Path(tmp)) if set(modes) - {"plain"} else None
        rows = [row for mode in modes for row in run_mode(mode, args, certs)]
    print(f"== {args.n} judge calls, mock judge {LATENCY_MS:g} ms (cv {LATENCY_CV}); "
          f"threads: {args.threads}")
    print(f"{'mode':<7}{'client':<15}{'calls/s':>9}{'cpu ms/call':>13}{'x aiohttp cpu':>15}")
    for row in rows:
        print(f"{row['mode']:<7}{row['client']:<15}{row['per_s']:>9.0f}"
              f"{row['cpu_ms_per_call']:>13.3f}{row['cpu_vs_aiohttp']:>15.2f}")
    if args.json:
        for row in rows:
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                              for k, v in row.items()}))


if __name__ == "__main__":
    main()
