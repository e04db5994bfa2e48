"""OpenRLHF (0.10.2+): the remote-RM reply shape, and a reward_func for its file mode.

OpenRLHF posts `{"query": [q], "prompts": [p], "labels": [l]}` per sample, where q is the
prompt plus the response decoded *with* special tokens; it wants
`{"rewards": [...], "scores": [...], "extra_logs": {name: [number]}}` within 180 s, and a
None reward breaks its batch. `qrq gateway` serves that over HTTP
(`--reward.remote_url http://host:8000/get_reward`). File mode
(`--reward.remote_url my_reward.py` holding
`from qreward_queue.integrations.openrlhf import reward_func`) calls `reward_func` in a thread.
Unscored samples get the fallback score and `qrq_ok = 0`.

Group judging (one judge call per GRPO group): put the route on a judge with
`mode = "group"` and set QRQ_BATCH_GROUP_SIZE to `--n_samples_per_prompt` where the gateway
(or the file-mode process) runs: the micro-batcher holds a prompt's responses until the group
is complete (or QRQ_BATCH_GROUP_WAIT_MS, 2000, has passed), then sends it whole.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..priority import Priority
from ..samples import Outcome
from ..trainer.batcher import default_batcher
from .coerce import make_sample

EOS_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<eos>")
DEADLINE_S = 150.0  # below OpenRLHF's 180 s client timeout


def response_of(query: str, prompt: str, eos_tokens: Sequence[str] = EOS_TOKENS) -> str:
    """The response inside OpenRLHF's query: the prompt prefix, trailing EOS tokens and
    surrounding whitespace removed."""
    text = query[len(prompt):] if prompt and query.startswith(prompt) else query
    stripped = True
    while stripped:
        stripped = False
        text = text.rstrip()
        for eos in eos_tokens:
            if eos and text.endswith(eos):
                text, stripped = text[: -len(eos)], True
    return text.strip()


def samples_of(queries: Sequence[str], prompts: Sequence[str],
               labels: Sequence[str | None] | None) -> list[dict[str, Any]]:
    """qrq samples for one OpenRLHF request."""
    labels = labels if labels is not None else [None] * len(queries)
    return [make_sample(p, response_of(q, p), label)
            for q, p, label in zip(queries, prompts, labels, strict=True)]


def reply(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """OpenRLHF's answer: numbers only (extra_logs become tensors)."""
    scores = [o.reward for o in outcomes]
    return {
        "rewards": scores,
        "scores": scores,
        "extra_logs": {"qrq_ok": [1.0 if o.scored else 0.0 for o in outcomes]},
    }


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict[str, Any]:
    """OpenRLHF file mode: called positionally, synchronously (in a thread), lists of one."""
    route = os.environ.get("QRQ_ROUTE") or None
    batcher = default_batcher()
    futures = [batcher.submit(s, route, Priority.TRAIN, DEADLINE_S)
               for s in samples_of(queries, prompts, labels)]
    return reply([f.result() for f in futures])
