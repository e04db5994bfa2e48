"""A reward-model server: `POST url {"items": [{prompt, response}, ...]}` -> `{"scores": [...]}`."""

from __future__ import annotations

from typing import Any

from ..errors import PermanentError
from .base import BackendClient, Call, checked_score, usage_split, usage_tokens
from .http import post_json


class RewardModelBackend(BackendClient):
    """Up to `batch_size` samples per call; a reply of the wrong shape fails the whole call,
    a bad score (not a number, too large, outside `score_range`) fails only its own item."""

    endpoint: str  # always over HTTP

    def __init__(self, config):
        super().__init__(config)
        self.endpoint = config.url

    @property
    def batch(self) -> int:
        return self.config.batch_size

    def estimate_usage(self, samples: list[dict]) -> tuple[float, float]:
        return sum(len(s["prompt"]) + len(s["response"]) for s in samples) / 4, 0.0

    def call(self, samples: list[dict]) -> Call:
        payload: dict = {
            "items": [{"prompt": s["prompt"], "response": s["response"]} for s in samples]
        }
        if self.config.model:
            payload["model"] = self.config.model
        reply = post_json(self.config, self.endpoint, payload)
        facts: dict[str, Any] = {"status_code": reply.status_code, "headers": reply.headers}
        scores = reply.body.get("scores") if isinstance(reply.body, dict) else None
        if not isinstance(scores, list) or len(scores) != len(samples):
            raise PermanentError(
                f"reply must hold 'scores': a list of {len(samples)} numbers",
                str(reply.body)[:500],
                **facts,
            )
        score_range = self.config.score_range
        return Call(
            [
                checked_score(None if isinstance(v, str) else v, score_range, f"scores[{i}]")
                for i, v in enumerate(scores)
            ],
            usage_tokens(reply.body),
            reply.status_code,
            reply.headers,
            [None] * len(samples),
            usage_split(reply.body),
        )
