"""A small forward proxy for the tests and benchmarks: CONNECT tunnels and plain HTTP, counted.

    python -m qreward_queue.testing.connect_proxy [--port 0] [--refuse]

It speaks what a training cluster's proxy (squid, tinyproxy) does for qrq: `CONNECT host:port`
opens a tunnel (200, then bytes both ways: TLS with the server inside), an absolute-form
request (`POST http://host:port/path`) is relayed to that host with the rest of its
connection. `GET /stats` (origin-form, to the proxy itself) answers its counts as JSON:
`tunnels` opened, `forwards` (plain connections relayed) and `refused` (with `--refuse`,
every CONNECT is answered 403, as a proxy that forbids the host).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import threading
from typing import Any

import click

_MAX_HEAD = 64 << 10
_TARGET = re.compile(rb"^http://([^/:\s]+|\[[^\]]+\])(?::(\d+))?/")


class ConnectProxy:
    """The proxy on its own event loop thread in this process; `url` once started."""

    def __init__(self, refuse: bool = False, port: int = 0) -> None:
        self.refuse, self.port = refuse, port
        self.counts = {"tunnels": 0, "forwards": 0, "refused": 0}
        self.loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def bind(self) -> ConnectProxy:
        self._server = self.loop.run_until_complete(
            asyncio.start_server(self._client, "127.0.0.1", self.port))
        return self

    def start(self) -> ConnectProxy:
        self.bind()
        self._thread = threading.Thread(target=self.loop.run_forever, name="connect-proxy",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the listener and every relay, then the loop."""

        async def close_all() -> None:
            assert self._server is not None
            self._server.close()
            relays = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in relays:
                task.cancel()
            await asyncio.gather(*relays, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close_all(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def __enter__(self) -> ConnectProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        method, target = ([*head.split(b" ", 2), b"", b""])[:2]
        if method == b"CONNECT":
            await self._tunnel(target.decode("latin-1"), reader, writer)
        elif (match := _TARGET.match(target)) is not None:
            self.counts["forwards"] += 1
            port = int(match.group(2) or 80)
            await self._relay(match.group(1).decode().strip("[]"), port, head, reader, writer)
        elif target == b"/stats":
            body = json.dumps(self.counts).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            writer.close()
        else:
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            writer.close()

    async def _tunnel(self, target: str, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        if self.refuse:
            self.counts["refused"] += 1
            writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
            writer.close()
            return
        self.counts["tunnels"] += 1
        host, _, port = target.rpartition(":")
        await self._relay(host.strip("[]"), int(port), None, reader, writer)

    async def _relay(self, host: str, port: int, first: bytes | None,
                     reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Bytes both ways between the client and host:port (`first`: the request head that
        came already; None: a tunnel, answered 200 first)."""
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
            writer.close()
            return
        if first is None:
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            up_writer.write(first)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


class ProxyProcess:
    """The proxy in a subprocess (its CPU apart from the client's): see spawn_proxy()."""

    def __init__(self, process: subprocess.Popen[str], url: str) -> None:
        self.process, self.url = process, url

    def stats(self) -> dict[str, Any]:
        import urllib.request

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"{self.url}/stats", timeout=10) as response:
            return json.load(response)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)
        if self.process.stdout:
            self.process.stdout.close()

    def __enter__(self) -> ProxyProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def spawn_proxy(refuse: bool = False) -> ProxyProcess:
    """Run the proxy as `python -m qreward_queue.testing.connect_proxy`; wait for its URL."""
    process = subprocess.Popen(
        [sys.executable, "-m", "qreward_queue.testing.connect_proxy",
         *(["--refuse"] if refuse else [])], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    match = re.search(r"listening on (http://\S+)", line)
    if match is None:
        process.kill()
        process.wait()
        raise RuntimeError(f"the proxy printed {line.strip()!r} instead of its URL")
    return ProxyProcess(process, match.group(1))


@click.command("connect-proxy")
@click.option("--port", default=0, show_default=True, help="0 picks a free port.")
@click.option("--refuse", is_flag=True, help="Answer every CONNECT 403.")
def proxy_cli(port: int, refuse: bool) -> None:
    """Serve the counting forward proxy until SIGTERM."""
    proxy = ConnectProxy(refuse, port).bind()
    click.echo(f"proxy listening on {proxy.url}")
    with contextlib.suppress(KeyboardInterrupt):
        proxy.loop.run_forever()


if __name__ == "__main__":
    proxy_cli()
