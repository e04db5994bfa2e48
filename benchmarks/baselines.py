"""The clients qrq is measured against, all sending the request qrq's judge backend sends.

(a) `naive`: one request after another, a fresh connection each, sleeping Retry-After on 429
    (what `qreward_queue.cli.demo.naive_score` does, timed per sample).
(b) `async_semaphore`: the "async batch reward manager" style: asyncio, `Semaphore(60)` calls at
    once over aiohttp, exponential backoff with full jitter on 429 (sleeping in its slot), and a
    silent 0.0 after the last attempt.
(c) `three_layer`: the verl rate-limited reward loop style: in-process token buckets for RPM and
    TPM (each holding one second of its rate, as verl builds them), then a concurrency semaphore,
    then the call under a timeout; any failure (a 429, a timeout) becomes a silent 0.0 as in verl.
(d) `token_throttle`: the token-throttle package (Redis backend): reserve one request before each
    call, settle it after, semaphore of max_concurrent, retry a 429 after Retry-After. Only runs
    where the package installs (it needs Python >= 3.12); `token_throttle_unavailable()` says why
    not.

Each client returns one `SampleResult` per sample, in order. Per-sample latency runs from the
moment the client commits a slot to the sample (request loop start for (a), the semaphore for
(b), the rate buckets' grant for (c) and (d)) until its score is ready, retries and backoff
included.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
import re
import sys
import time

import requests
from common import SampleResult

from qreward_queue.backends.judge import JudgeBackend
from qreward_queue.config.model import Backend

SEMAPHORE = 60
BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 30.0
BACKOFF_ATTEMPTS = 8
VERL_TIMEOUT_S = 60.0
VERL_TOKENS_PER_REQUEST = 2000  # verl's default estimate for its TPM bucket


class _Request:
    """The judge request for a sample and how to read its score, as qrq's judge backend does."""

    def __init__(self, backend: Backend):
        self.judge = JudgeBackend(backend)
        self.backend = backend
        self.endpoint = self.judge.endpoint
        self.pattern = re.compile(self.judge.options.score_pattern)

    def payload(self, sample: dict) -> dict:
        return {
            "model": self.judge.options.model,
            "messages": self.judge.messages(sample),
            "max_tokens": self.judge.options.max_tokens,
            "temperature": 0,
        }

    def score(self, body: dict) -> float:
        return float(self.pattern.search(body["choices"][0]["message"]["content"]).group(1))


def _retry_after_s(headers) -> float:
    ms = headers.get("retry-after-ms")
    return float(ms) / 1000 if ms is not None else float(headers.get("retry-after", 1))


# (a) --------------------------------------------------------------------------------------------
def naive(backend: Backend, samples: list[dict]) -> list[SampleResult]:
    """One request after another, a fresh connection each time, Retry-After on 429."""
    req = _Request(backend)
    out = []
    for sample in samples:
        started = time.perf_counter()
        while True:
            reply = requests.post(req.endpoint, json=req.payload(sample),
                                  timeout=backend.timeout_s)
            if reply.status_code != 429:
                break
            time.sleep(_retry_after_s(reply.headers))
        ok = reply.status_code == 200
        score = req.score(reply.json()) if ok else 0.0
        out.append(SampleResult(score, ok, (time.perf_counter() - started) * 1000))
    return out


# (b) --------------------------------------------------------------------------------------------
def async_semaphore(backend: Backend, samples: list[dict], concurrency: int = SEMAPHORE,
                    ssl_context=None, proxy: str | None = None) -> list[SampleResult]:
    """asyncio + aiohttp, `concurrency` calls at once, exponential backoff on 429 (over TLS
    trusting `ssl_context`, through `proxy` when given)."""
    return asyncio.run(_async_semaphore(backend, samples, concurrency, ssl_context, proxy))


async def _async_semaphore(backend, samples, concurrency, ssl_context=None, proxy=None):
    import aiohttp

    req = _Request(backend)
    semaphore = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=backend.timeout_s)

    async def one(session, sample) -> SampleResult:
        async with semaphore:
            started = time.perf_counter()
            for attempt in range(BACKOFF_ATTEMPTS):
                try:
                    async with session.post(req.endpoint, json=req.payload(sample),
                                            proxy=proxy) as resp:
                        body = await resp.json(content_type=None)
                        if resp.status == 200:
                            latency = (time.perf_counter() - started) * 1000
                            return SampleResult(req.score(body), True, latency)
                        if resp.status != 429:
                            break
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
                delay = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt)
                await asyncio.sleep(random.uniform(0, delay))
            return SampleResult(0.0, False, (time.perf_counter() - started) * 1000)

    connector = aiohttp.TCPConnector(limit=concurrency, ssl=ssl_context or True)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        return await asyncio.gather(*(one(session, s) for s in samples))


# (c) --------------------------------------------------------------------------------------------
class TokenBucket:
    """verl-style asyncio token bucket: starts full, holds one second of `per_s`, waits when
    short; a cost above the capacity passes after its wait and leaves the level negative."""

    def __init__(self, per_s: float):
        self.rate = per_s
        self.capacity = per_s
        self.level = per_s
        self.stamp: float | None = None
        self.lock = asyncio.Lock()

    def _refill(self, now: float) -> None:
        if self.stamp is not None:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    async def acquire(self, cost: float = 1.0) -> None:
        if cost > self.capacity:  # pass after its fair wait, leaving the level in debt
            async with self.lock:
                self._refill(asyncio.get_running_loop().time())
                wait = max(0.0, cost - self.level) / self.rate
                self.level -= cost
            await asyncio.sleep(wait)
            return
        while True:
            async with self.lock:
                self._refill(asyncio.get_running_loop().time())
                if self.level >= cost:
                    self.level -= cost
                    return
                wait = (cost - self.level) / self.rate
            await asyncio.sleep(wait)


def three_layer(backend: Backend, samples: list[dict], rpm: float, tpm: float | None,
                max_concurrent: int, timeout_s: float = VERL_TIMEOUT_S) -> list[SampleResult]:
    """RPM bucket -> TPM bucket -> semaphore -> call under a timeout; failures score 0.0."""
    return asyncio.run(_three_layer(backend, samples, rpm, tpm, max_concurrent, timeout_s))


async def _three_layer(backend, samples, rpm, tpm, max_concurrent, timeout_s):
    import aiohttp

    req = _Request(backend)
    rpm_bucket = TokenBucket(rpm / 60) if rpm else None
    tpm_bucket = TokenBucket(tpm / 60) if tpm else None
    semaphore = asyncio.Semaphore(max_concurrent)

    async def call(session, sample) -> float:
        async with session.post(req.endpoint, json=req.payload(sample)) as resp:
            resp.raise_for_status()  # a 429 is an exception, like in a plain compute_score
            return req.score(await resp.json(content_type=None))

    async def one(session, sample) -> SampleResult:
        if rpm_bucket:
            await rpm_bucket.acquire(1)
        if tpm_bucket:
            await tpm_bucket.acquire(VERL_TOKENS_PER_REQUEST)
        started = time.perf_counter()
        async with semaphore:
            try:
                score = await asyncio.wait_for(call(session, sample), timeout_s)
                ok = True
            except Exception:  # verl: "Reward computation failed ..." -> reward 0.0
                score, ok = 0.0, False
        return SampleResult(score, ok, (time.perf_counter() - started) * 1000)

    connector = aiohttp.TCPConnector(limit=max_concurrent)
    async with aiohttp.ClientSession(connector=connector) as session:
        return await asyncio.gather(*(one(session, s) for s in samples))


# (d) --------------------------------------------------------------------------------------------
def token_throttle_unavailable() -> str | None:
    """Why baseline (d) cannot run here, or None when it can."""
    if sys.version_info < (3, 12):
        return (f"token-throttle skipped: every release on PyPI requires Python >= 3.12 and this "
                f"venv runs {sys.version.split()[0]} (pip finds no installable version)")
    if importlib.util.find_spec("token_throttle") is None:
        return "token-throttle skipped: not installed (pip install 'token-throttle[redis]')"
    return None


def token_throttle(backend: Backend, samples: list[dict], redis_url: str, rpm: float,
                   max_concurrent: int) -> list[SampleResult]:
    """token-throttle's reserve -> call -> settle over its Redis backend (v10 API)."""
    return asyncio.run(_token_throttle(backend, samples, redis_url, rpm, max_concurrent))


async def _token_throttle(backend, samples, redis_url, rpm, max_concurrent):
    import aiohttp
    import redis.asyncio as aredis
    from token_throttle import (  # type: ignore[import-not-found]
        PerModelConfig,
        Quota,
        RateLimiter,
        RedisBackendBuilder,
        UsageQuotas,
    )

    req = _Request(backend)
    client = aredis.from_url(redis_url)
    limiter = RateLimiter(
        PerModelConfig(quotas=UsageQuotas([Quota(metric="requests", limit=int(rpm),
                                                 per_seconds=60)])),
        backend=RedisBackendBuilder(client, key_prefix="qrqbench"),
    )
    semaphore = asyncio.Semaphore(max_concurrent)

    async def one(session, sample) -> SampleResult:
        started = None
        for _ in range(BACKOFF_ATTEMPTS * 4):
            reservation = await limiter.acquire_capacity(model="mock", usage={"requests": 1})
            started = started or time.perf_counter()
            async with semaphore, session.post(req.endpoint, json=req.payload(sample)) as resp:
                body = await resp.json(content_type=None)
            await limiter.refund_capacity(actual_usage={"requests": 1}, reservation=reservation)
            if resp.status == 200:
                return SampleResult(req.score(body), True, (time.perf_counter() - started) * 1000)
            if resp.status != 429:
                break
            await asyncio.sleep(_retry_after_s(resp.headers))
        return SampleResult(0.0, False, (time.perf_counter() - (started or 0)) * 1000)

    try:
        connector = aiohttp.TCPConnector(limit=max_concurrent)
        async with aiohttp.ClientSession(connector=connector) as session:
            return await asyncio.gather(*(one(session, s) for s in samples))
    finally:
        await limiter.aclose()
        await client.aclose()
