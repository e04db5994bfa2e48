"""The two clients `qrq demo` compares qrq with, as a user would write them without qrq.

- `naive_score`: one request after another, a fresh connection each time (the standard
  library's urllib, so the demo needs nothing beyond the package).
- `semaphore_score`: asyncio with `Semaphore(64)` requests in flight over keep-alive
  connections, spread round-robin over the route's judges (the "async batch reward manager"
  style). Written on the standard library's asyncio streams so the demo needs nothing beyond
  the package; it speaks just enough HTTP/1.1 for a local mock judge.

Both sleep the 429's Retry-After and try again, so every score comes back right and the cost
of a 429 storm shows up as time.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from urllib.parse import urlsplit

from ..backends.judge import JudgeBackend
from ..config.model import Backend

SEMAPHORE = 64


def _request(judge: JudgeBackend, sample: dict) -> dict:
    return {"model": judge.options.model, "messages": judge.messages(sample), "max_tokens": 16}


def _retry_after_s(headers: dict[str, str]) -> float:
    ms = headers.get("retry-after-ms")
    return float(ms) / 1000 if ms is not None else float(headers.get("retry-after", 1))


def _score(judge: JudgeBackend, body: dict) -> float:
    found = judge.pattern.search(body["choices"][0]["message"]["content"])
    if found is None:
        raise ValueError("the judge's reply holds no score")
    return float(found.group(1))


def _post(url: str, payload: dict, timeout_s: float) -> tuple[int, dict[str, str], bytes]:
    """One POST on a fresh connection: status, lower-cased headers, body (errors included)."""
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return reply.status, {k.lower(): v for k, v in reply.headers.items()}, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def naive_score(backend: Backend, samples: list[dict],
                progress: Callable[[int], None] | None = None) -> list[float]:
    """What a plain script does: one request after another, sleeping Retry-After on 429;
    `progress(done)` after each sample."""
    judge = JudgeBackend(backend)
    scores = []
    for sample in samples:
        while True:
            status, headers, body = _post(judge.endpoint, _request(judge, sample),
                                          backend.timeout_s)
            if status != 429:
                break
            time.sleep(_retry_after_s(headers))
        if status != 200:
            raise RuntimeError(f"{judge.endpoint} answered {status}: {body[:200]!r}")
        scores.append(_score(judge, json.loads(body)))
        if progress is not None:
            progress(len(scores))
    return scores


class _Connections:
    """Idle keep-alive connections to one host, reused by whichever coroutine needs one."""

    def __init__(self, url: str):
        parts = urlsplit(url)
        self.host, self.port, self.path = parts.hostname, parts.port or 80, parts.path
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self, payload: dict) -> tuple[int, dict[str, str], bytes]:
        reader, writer = (
            self.idle.pop() if self.idle else await asyncio.open_connection(self.host, self.port)
        )
        body = json.dumps(payload).encode()
        writer.write(
            f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        reply = await reader.readexactly(int(headers.get("content-length", 0)))
        if headers.get("connection", "").lower() == "close":
            writer.close()
        else:
            self.idle.append((reader, writer))
        return status, headers, reply

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()


async def _semaphore_score(backends: list[Backend], samples: list[dict]) -> list[float]:
    judges = [JudgeBackend(b) for b in backends]
    connections = [_Connections(j.endpoint) for j in judges]
    slots = asyncio.Semaphore(SEMAPHORE)

    async def one(i: int, sample: dict) -> float:
        which = i % len(backends)
        async with slots:
            while True:
                status, headers, body = await connections[which].post(
                    _request(judges[which], sample)
                )
                if status != 429:
                    break
                await asyncio.sleep(_retry_after_s(headers))
        if status != 200:
            raise RuntimeError(f"{judges[which].endpoint} answered {status}: {body[:200]!r}")
        return _score(judges[which], json.loads(body))

    try:
        return list(await asyncio.gather(*(one(i, s) for i, s in enumerate(samples))))
    finally:
        for c in connections:
            c.close()


def semaphore_score(backends: list[Backend], samples: list[dict]) -> list[float]:
    """asyncio, `Semaphore(64)` in flight, sample i on backends[i % len(backends)]."""
    return asyncio.run(_semaphore_score(backends, samples))
