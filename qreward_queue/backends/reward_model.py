"""A reward-model server: `POST url {"items": [{prompt, response}, ...]}` -> `{"scores": [...]}`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ..config.model import Backend, KindOptions
from ..config.toml_table import Table, read_fields
from ..errors import PermanentError
from .base import Call, checked_score, read_score_range, usage_split, usage_tokens
from .http import HttpBackend, HttpOptions

if TYPE_CHECKING:
    from .transport import Reply


@dataclass(frozen=True, kw_only=True)
class RewardModelOptions(HttpOptions):
    """A reward model's own keys of `[backend]` (with the HTTP ones)."""

    model: str | None = None  # sent as `model` when set
    batch_size: int = 16  # samples per call
    score_range: tuple[float, float] | None = None  # a score outside it is an error


class RewardModelBackend(HttpBackend):
    """Up to `batch_size` samples per call; a reply of the wrong shape fails the whole call,
    a bad score (not a number, too large, outside `score_range`) fails only its own item."""

    Options: ClassVar[type[KindOptions]] = RewardModelOptions

    def __init__(self, config: Backend):
        super().__init__(config)
        self.options = config.options_as(RewardModelOptions)

    @classmethod
    def read_options(cls, b: Table) -> KindOptions:
        return read_fields(b, RewardModelOptions, **cls.read_http(b),
                           score_range=read_score_range(b, None))

    @property
    def samples_per_call(self) -> int:
        return self.options.batch_size

    def identity(self) -> list[Any]:
        return [*super().identity(), self.options.model]

    def request(self, samples: list[dict]) -> dict:
        payload: dict = {
            "items": [{"prompt": s["prompt"], "response": s["response"]} for s in samples]
        }
        if self.options.model:
            payload["model"] = self.options.model
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
        score_range = self.options.score_range
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
