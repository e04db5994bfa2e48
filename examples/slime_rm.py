"""slime on qrq: run `python examples/slime_rm.py` (mock judge, no GPU, no slime needed).

In training: `--custom-rm-path qreward_queue.integrations.slime.rm`, with QRQ_REDIS_URL,
QRQ_CONFIG (and QRQ_ROUTE for a route other than the default) in the rollout workers'
environment; for validation, `metadata_overrides: {qrq_priority: val}` in the eval dataset
config. Or use slime's remote RM: `--rm-type remote_rm --rm-url http://gateway:8000/slime`
with `qrq gateway`. This script awaits the RM as slime does: one Sample, and a group list.
"""

from __future__ import annotations

import asyncio
import json
import types
from dataclasses import dataclass, field

from _mock_stack import mock_stack

from qreward_queue.integrations.slime import rm


@dataclass
class Sample:  # the fields of slime.utils.types.Sample the RM uses
    prompt: str | list[dict] = ""
    response: str = ""
    label: str | None = None
    metadata: dict = field(default_factory=dict)
    remove_sample: bool = False


async def rollout(args) -> list[tuple[float, Sample]]:
    group = [Sample("What is 2+2?", r, "4") for r in ["4", "5", "four"]]
    single = Sample([{"role": "user", "content": "What is 2+2?"}], "=4", "4")
    scores, score = await asyncio.gather(rm(args, group), rm(args, single))
    return [*zip(scores, group, strict=True), (score, single)]


if __name__ == "__main__":
    with mock_stack():
        for score, sample in asyncio.run(rollout(types.SimpleNamespace())):
            print(json.dumps({"score": score, "qrq_status": sample.metadata["qrq_status"],
                              "remove_sample": sample.remove_sample}))
