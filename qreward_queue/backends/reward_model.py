"""A reward-model server: `POST url {"items": [{prompt, response}, ...]}` -> `{"scores": [...]}`."""

from __future__ import annotations

import math

from ..errors import PermanentError
from .base import BackendClient, Call
from .http import post_json


class RewardModelBackend(BackendClient):
    """Up to `batch_size` samples per call; a reply of the wrong shape fails the whole call."""

    @property
    def batch(self) -> int:
        return self.config.batch_size

    def estimate_tokens(self, samples: list[dict]) -> float:
        return sum(len(s["prompt"]) + len(s["response"]) for s in samples) / 4

    def call(self, samples: list[dict]) -> Call:
        payload: dict = {
            "items": [{"prompt": s["prompt"], "response": s["response"]} for s in samples]
        }
        if self.config.model:
            payload["model"] = self.config.model
        reply = post_json(self.config, self.config.url, payload)
        facts = {"status_code": reply.status_code, "headers": reply.headers}
        scores = reply.body.get("scores") if isinstance(reply.body, dict) else None
        if not isinstance(scores, list) or len(scores) != len(samples):
            raise PermanentError(
                f"reply must hold 'scores': a list of {len(samples)} numbers",
                str(reply.body)[:500],
                **facts,
            )
        bad = [i for i, v in enumerate(scores) if not _is_number(v)]
        if bad:
            raise PermanentError(
                f"scores[{bad[0]}] is not a finite number", str(scores[bad[0]])[:200], **facts
            )
        usage = reply.body.get("usage")
        tokens = usage.get("total_tokens") if isinstance(usage, dict) else None
        return Call(
            [float(v) for v in scores],
            tokens if isinstance(tokens, int) else None,
            reply.status_code,
            reply.headers,
            [None] * len(samples),
        )


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
