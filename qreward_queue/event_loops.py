"""The event loops qrq runs itself: the worker's call loop and the gateway's server.

Why uvloop where it is installed (a core dependency on Linux and macOS): a worker's call loop
is most of its CPU at a few thousand calls a second (each reply is a protocol callback, a
timer, a task step), and on uvloop those cost a fraction of asyncio's. `QRQ_EVENT_LOOP=asyncio`
keeps asyncio's own loop (to compare, or to rule the loop out when chasing a bug).
"""

from __future__ import annotations

import asyncio
import os

ENV = "QRQ_EVENT_LOOP"


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's unless it is missing or `QRQ_EVENT_LOOP=asyncio`."""
    if os.environ.get(ENV, "").strip().lower() != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()
