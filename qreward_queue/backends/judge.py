"""LLM-as-judge over an OpenAI-compatible `POST {url}/chat/completions`, one sample per call."""

from __future__ import annotations

import math
import re

from ..errors import PermanentError
from .base import BackendClient, Call
from .http import post_json


class JudgeBackend(BackendClient):
    """Fills the prompt template from the sample and parses the score out of the reply.

    An unparseable reply is an `error` outcome quoting the reply, never a silent 0.
    """

    def __init__(self, config):
        super().__init__(config)
        self.pattern = re.compile(config.score_pattern)
        self.endpoint = config.url.rstrip("/") + "/chat/completions"

    def render(self, sample: dict) -> str:
        """The user message the judge sees for `sample`."""
        return self.config.prompt_template.format(
            prompt=sample["prompt"],
            response=sample["response"],
            reference=sample.get("reference") or "",
            data_source=sample.get("data_source") or "",
            extra=sample.get("extra") or {},
        )

    def messages(self, sample: dict) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.config.system_prompt}]
        return (system if self.config.system_prompt else []) + [
            {"role": "user", "content": self.render(sample)}
        ]

    def estimate_tokens(self, samples: list[dict]) -> float:
        chars = sum(len(m["content"]) for s in samples for m in self.messages(s))
        return chars / 4 + self.config.max_tokens * len(samples)

    def call(self, samples: list[dict]) -> Call:
        (sample,) = samples
        payload = {
            "model": self.config.model,
            "messages": self.messages(sample),
            "max_tokens": self.config.max_tokens,
            "temperature": 0,
        }
        reply = post_json(self.config, self.endpoint, payload)
        facts = {"status_code": reply.status_code, "headers": reply.headers}
        try:
            content = reply.body["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise PermanentError(
                "reply has no choices[0].message.content", str(reply.body)[:500], **facts
            ) from None
        if not isinstance(content, str):
            raise PermanentError(
                "choices[0].message.content is not text", str(content)[:500], **facts
            )
        match = self.pattern.search(content)
        score = _to_float(match.group(1)) if match else None
        if score is None:
            raise PermanentError(
                f"no score in the judge's reply (pattern {self.pattern.pattern!r})",
                content[:500],
                **facts,
            )
        usage = reply.body.get("usage") if isinstance(reply.body, dict) else None
        tokens = usage.get("total_tokens") if isinstance(usage, dict) else None
        return Call(
            [score],
            tokens if isinstance(tokens, int) else None,
            reply.status_code,
            reply.headers,
            [content[:500]],
        )


def _to_float(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None
