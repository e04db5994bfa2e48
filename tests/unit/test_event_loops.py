"""The loops qrq runs itself: uvloop's by default, asyncio's when QRQ_EVENT_LOOP says so."""

from __future__ import annotations

import asyncio

import uvloop

from qreward_queue.background import EVENT_LOOP_ENV as ENV
from qreward_queue.background import new_event_loop


def _kind(monkeypatch, value: str | None) -> type:
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    loop = new_event_loop()
    try:
        assert loop.run_until_complete(asyncio.sleep(0, "ran")) == "ran"
        return type(loop)
    finally:
        loop.close()


def test_uvloop_by_default(monkeypatch):
    assert _kind(monkeypatch, None) is uvloop.Loop
    assert _kind(monkeypatch, "uvloop") is uvloop.Loop


def test_asyncio_loop_when_asked(monkeypatch):
    kind = _kind(monkeypatch, " AsyncIO ")
    assert kind is not uvloop.Loop and issubclass(kind, asyncio.BaseEventLoop)
