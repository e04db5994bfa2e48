"""A reward-model server: `POST url {"items": [{prompt, response}, ...]}` -> `{"scores": [...]}`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..config.model import Backend
from ..config.toml_table import Table
from ..errors import PermanentError
from .base import Call, checked_score, read_score_range, usage_split, usage_tokens
from .http import HttpBackend

if TYPE_CHECKING:
    from .transport import Reply


class RewardModelBackend(HttpBackend):
    """Up to `batch_size` samples per call; a reply of the wrong shape fails the whole call,
    a bad score (not a number, too large, outside `score_range`) fails only its own item."""

    @classmethod
    def read_options(cls, b: Table) -> dict[str, Any]:
        values = super().read_options(b)
        values["model"] = b.get("model", str, None)
        values["batch_size"] = b.integer("batch_size", Backend.batch_size)
        values["score_range"] = read_score_range(b, None)
        return values

    @property
    def samples_per_call(self) -> int:
        return self.config.batch_size

    def request(self, samples: list[dict]) -> dict:
        payload: dict = {
            "items": [{"prompt": s["prompt"], "response": s["response"]} for s in samples]
        }
        if self.config.model:
            payload["model"] = self.config.model
        return payload

    def answer(self, samples: list[dict], reply: Reply) -> Call:
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
