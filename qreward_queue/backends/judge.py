"""LLM-as-judge over an OpenAI-compatible `POST {url}/chat/completions`, one sample per call."""

from __future__ import annotations

import re
from typing import Any

from ..errors import PermanentError
from ..settings import DEFAULT_SCORE_PATTERN, DEFAULT_TEMPLATE, Backend
from ..toml_table import Table
from .base import Call, checked_score, read_score_range, usage_split, usage_tokens
from .http import HttpBackend

SCORE_MATCHES = ("unique", "first", "last")


class JudgeBackend(HttpBackend):
    """Fills the prompt template from the sample and parses the score out of the reply.

    An unparseable reply is an `error` outcome quoting the reply, never a silent 0; so is a
    score that is not finite, outside `score_range`, or ambiguous (several different scores
    when `score_match` is "unique").
    """

    def __init__(self, config: Backend):
        super().__init__(config)
        self.pattern = re.compile(config.score_pattern)
        self.endpoint = self.endpoint.rstrip("/") + "/chat/completions"

    @classmethod
    def read_options(cls, b: Table) -> dict[str, Any]:
        values = super().read_options(b)
        values["model"] = b.get("model", str, required=True, expected="a model name")
        values["prompt_template"] = b.get("prompt_template", str, DEFAULT_TEMPLATE)
        values["system_prompt"] = b.get("system_prompt", str, None)
        values["score_pattern"] = b.get("score_pattern", str, DEFAULT_SCORE_PATTERN)
        values["max_tokens"] = b.integer("max_tokens", Backend.max_tokens)
        try:
            if re.compile(values["score_pattern"]).groups < 1:
                raise b.fail("score_pattern", "a regex with one capture group for the score")
        except re.error as exc:
            raise b.fail("score_pattern", f"a valid regex ({exc})") from None
        _check_template(b, values["prompt_template"])
        values["score_match"] = b.get("score_match", str, "unique")
        if values["score_match"] not in SCORE_MATCHES:
            raise b.fail("score_match", f"one of {', '.join(SCORE_MATCHES)}")
        # the default template asks for a score from 0 to 1
        default_range = (0.0, 1.0) if values["prompt_template"] == DEFAULT_TEMPLATE else None
        values["score_range"] = read_score_range(b, default_range)
        return values

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
        system = [{"role": "system", "content": self.config.system_prompt or ""}]
        return (system if self.config.system_prompt else []) + [
            {"role": "user", "content": self.render(sample)}
        ]

    def estimate_usage(self, samples: list[dict]) -> tuple[float, float]:
        chars = sum(len(m["content"]) for s in samples for m in self.messages(s))
        return chars / 4, float(self.config.max_tokens * len(samples))

    def call(self, samples: list[dict]) -> Call:
        (sample,) = samples
        payload = {
            "model": self.config.model,
            "messages": self.messages(sample),
            "max_tokens": self.config.max_tokens,
            "temperature": 0,
        }
        reply = self.post(payload)
        facts: dict[str, Any] = {"status_code": reply.status_code, "headers": reply.headers}
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
        score = self.parse_score(content)
        if isinstance(score, PermanentError):
            raise PermanentError(str(score), score.detail, **facts)
        return Call(
            [score], usage_tokens(reply.body), reply.status_code, reply.headers, [content[:500]],
            usage_split(reply.body),
        )

    def parse_score(self, content: str) -> float | PermanentError:
        """The score in the judge's reply per `score_pattern` and `score_match`."""
        found = [m.group(1) for m in self.pattern.finditer(content)]
        if not found:
            return PermanentError(
                f"no score in the judge's reply (pattern {self.pattern.pattern!r})", content[:500]
            )
        policy = self.config.score_match
        if policy == "unique" and len(set(map(_number_or_text, found))) > 1:
            return PermanentError(
                f"{len(found)} different scores in the judge's reply ({', '.join(found[:5])}); "
                'set score_match = "first" or "last" to pick one',
                content[:500],
            )
        text = found[-1] if policy == "last" else found[0]
        return checked_score(text, self.config.score_range, f"score {text!r}", content[:500])


def _check_template(t: Table, template: str) -> None:
    fields = {"prompt": "", "response": "", "reference": "", "data_source": "", "extra": {}}
    try:
        template.format(**fields)
    except Exception as exc:  # str.format can raise almost anything on a bad template
        raise t.fail(
            "prompt_template",
            "placeholders among {prompt} {response} {reference} "
            f"{{data_source}} {{extra}} ({exc!r})",
        ) from None


def _number_or_text(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text
