"""OpenRLHF on qrq through `qrq gateway`: run `python examples/openrlhf_gateway.py`.

In training, start the gateway next to your workers and point OpenRLHF at it:

    QRQ_CONFIG=/shared/qrq.toml QRQ_REDIS_URL=redis://host:6379/0 qrq gateway --host 0.0.0.0
    openrlhf ... --reward.remote_url http://gateway-host:8000/get_reward

This script starts the gateway in-process on a free port and posts what OpenRLHF's
SingleTurnAgentExecutor posts: one sample per request, the query being prompt + response
with the EOS token, several requests at once.
"""

from __future__ import annotations

import asyncio
import json
import socket

from _mock_stack import mock_stack, needs

aiohttp = needs("aiohttp")  # `pip install 'qreward-queue[gateway]'`, as `qrq gateway` needs
PROMPT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"


async def main() -> list[dict]:
    from aiohttp import web

    from qreward_queue.integrations.gateway import Gateway

    runner = web.AppRunner(Gateway("judge").app())
    await runner.setup()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
            async def post(response: str) -> dict:
                body = {"query": [PROMPT + response + "<|im_end|>"], "prompts": [PROMPT],
                        "labels": ["4"]}
                async with session.post(f"http://127.0.0.1:{port}/get_reward", json=body) as r:
                    return await r.json()
            return await asyncio.gather(*map(post, ["4", "5", "four", "=4"]))
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    with mock_stack():
        for reply in asyncio.run(main()):
            print(json.dumps(reply))
