"""LLM-as-judge over an OpenAI-compatible `POST {url}/chat/completions`: one sample per call,
or with `mode = "group"` one GRPO group per call (groups.py: the wire format). A gateway's
caller's own request goes out as it came (passthrough.py), a text completion to
`{url}/completions`.

A response is text a policy wrote to earn reward, so it never reaches the judge's
instructions or the parser: `{response}` is fenced in a tag it cannot close
(injection.fence), and the score is read from the judge's own part of the reply: the JSON
verdict of `response_format` with `structured = true`, else the pattern's matches that do not
quote the response (`own_matches`). A response that addresses its judge is flagged in the
outcome's detail (injection.detect).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from ..config.model import Backend, KindOptions
from ..config.toml_table import Table, read_fields
from ..errors import ConfigError, PermanentError, ScoringError
from ..priority import CALL_LEVEL
from ..samples import flag
from . import groups, injection, passthrough
from .base import Call, checked_score, read_score_range, usage_split, usage_tokens
from .dialects import DIALECTS, Dialect
from .http import HttpBackend, HttpOptions

if TYPE_CHECKING:
    from .transport import Reply

SCORE_MATCHES = ("unique", "first", "last")
MODES = ("sample", "group")
_GROUP_KEYS = ("group_template", "group_max", "group_pattern")
DEFAULT_TEMPLATE = (
    "Rate the response to the prompt on a scale from 0 to 1.\n"
    "Prompt: {prompt}\nResponse: {response}\nReference: {reference}\n"
    "Answer with 'Score: <number>'."
)
# the exponent is part of the number, so "Score: 1e309" reads as 1e309 (an error), never as 1;
# ASCII digits only, and a number that goes on ("0.5.5", "1/2", "1,5", "0x1", "١") is no match
DEFAULT_SCORE_PATTERN = (
    r"Score:\s*([-+]?(?:[0-9]+(?:\.[0-9]+)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)(?!\w|[.,/]\w)"
)
MESSAGE_OVERHEAD_BYTES = 16  # a chat message's role and template tokens, as bytes


@dataclass(frozen=True, kw_only=True)
class JudgeOptions(HttpOptions):
    """A judge's own keys of `[backend]` (with the HTTP ones): what it asks and how it reads
    the score."""

    model: str = field(metadata={"expected": "a model name"})  # sent as the call's `model`
    prompt_template: str = DEFAULT_TEMPLATE
    system_prompt: str | None = None
    score_pattern: str = DEFAULT_SCORE_PATTERN
    max_tokens: int = 16
    # a score outside it is an error; the default templates ask for scores from 0 to 1
    score_range: tuple[float, float] | None = None
    # several scores in one reply: unique | first | last
    score_match: str = field(default="unique", metadata={"choices": SCORE_MATCHES})
    # "sample" (one call per sample) or "group" (one call per group, groups.py)
    mode: str = "sample"
    group_template: str | None = None  # None: groups.DEFAULT_GROUP_TEMPLATE
    group_max: int = 16  # the most responses one group call holds (larger groups are split)
    group_pattern: str | None = None  # tagged scores (number, score); None: a JSON list/object
    # the response fenced in a tag it cannot close (injection.fence), and the verdict asked as
    # JSON by `response_format` (a server that supports it: OpenAI, vLLM, SGLang)
    fence: bool = True
    structured: bool = False
    priority_field: bool = False  # send the call's priority as `priority` (vLLM, SGLang)

class JudgeBackend(HttpBackend):
    """Fills the prompt template from the sample and parses the score out of the reply.

    An unparseable reply is an `error` outcome quoting the reply, never a silent 0; so is a
    score that is not finite, outside `score_range`, or ambiguous (several different scores
    when `score_match` is "unique").
    """

    Options: ClassVar[type[KindOptions]] = JudgeOptions

    def __init__(self, config: Backend):
        super().__init__(config)
        self.options = config.options_as(JudgeOptions)
        self.pattern = re.compile(self.options.score_pattern)
        self.dialect = DIALECTS[self.options.dialect]
        base = self.endpoint.rstrip("/")
        self.endpoint = base + self.dialect.path
        self.text_endpoint = base + self.dialect.text_path if self.dialect.text_path else None

    @classmethod
    def read_dialect(cls, table: Table) -> Dialect:
        name = table.get("dialect", str, "openai")
        if name not in DIALECTS:
            raise table.fail("dialect", f"one of {', '.join(DIALECTS)}")
        return DIALECTS[name]

    @classmethod
    def read_options(cls, b: Table) -> KindOptions:
        values = cls.read_http(b)
        score_pattern = b.get("score_pattern", str, DEFAULT_SCORE_PATTERN)
        try:
            if re.compile(score_pattern).groups < 1:
                raise b.fail("score_pattern", "a regex with one capture group for the score")
        except re.error as exc:
            raise b.fail("score_pattern", f"a valid regex ({exc})") from None
        prompt_template = b.get("prompt_template", str, DEFAULT_TEMPLATE)
        _check_template(b, prompt_template)
        values.update(_group_options(b))
        template = values["group_template"] or prompt_template
        default = groups.DEFAULT_GROUP_TEMPLATE if values["group_template"] else DEFAULT_TEMPLATE
        default_range = (0.0, 1.0) if template == default else None
        return read_fields(b, JudgeOptions, score_pattern=score_pattern,
                           prompt_template=prompt_template,
                           score_range=read_score_range(b, default_range), **values)

    @property
    def sends_priority(self) -> bool:
        return self.options.priority_field

    @property
    def grouped(self) -> bool:
        return self.options.mode == "group"

    def units(self, samples: list[dict]) -> list[list[int]]:
        """Group mode: whole groups (a chunk holds each or none of it)."""
        return groups.group_indices(samples) if self.grouped else super().units(samples)

    def split(self, samples: list[dict]) -> list[list[int]]:
        """Group mode: one call per group, split to at most `group_max` responses."""
        if self.grouped:
            return groups.plan_groups(samples, self.options.group_max)
        return super().split(samples)

    def identity(self) -> list[Any]:
        o = self.options
        extra = [o.mode, o.group_template, o.group_max, o.group_pattern] if self.grouped else []
        return [*super().identity(), o.model, o.prompt_template, o.system_prompt,
                o.score_pattern, o.max_tokens, o.fence, o.structured, *extra]

    def render(self, sample: dict) -> str:
        """The user message the judge sees for `sample` (in sample mode): the response fenced,
        and the judge told so after it."""
        response = sample["response"]
        if self.options.fence:
            tag = injection.fence([response])
            response = f"<{tag}>\n{response}\n</{tag}>\n{injection.fence_note(tag)}"
        return self.options.prompt_template.format(
            prompt=sample["prompt"],
            response=response,
            reference=sample.get("reference") or "",
            data_source=sample.get("data_source") or "",
            extra=sample.get("extra") or {},
        )

    def messages(self, sample: dict) -> list[dict[str, str]]:
        return self.call_messages([sample])

    def call_messages(self, samples: list[dict]) -> list[dict[str, str]]:
        """What one call sends: its sample, or in group mode its group rendered at once."""
        if self.grouped:
            template = self.options.group_template or groups.DEFAULT_GROUP_TEMPLATE
            content = groups.render_group(template, samples, self.options.fence)
        else:
            (sample,) = samples
            content = self.render(sample)
        system = [{"role": "system", "content": self.options.system_prompt or ""}]
        return (system if self.options.system_prompt else []) + [
            {"role": "user", "content": content}
        ]

    def estimate_usage(self, samples: list[dict]) -> tuple[float, float]:
        """The calls' messages (a group's prompt counted once) and max_tokens per sample."""
        if samples and passthrough.caller_request(samples[0]) is not None:  # a gateway's batch
            return passthrough.estimate_usage(samples, self.options.max_tokens)
        calls = [[samples[i] for i in call] for call in self.split(samples)]
        chars = sum(len(m["content"]) for call in calls for m in self.call_messages(call))
        return chars / 4, float(self.options.max_tokens * len(samples))

    def input_bytes(self, samples: list[dict]) -> int:
        """The calls' messages, each with MESSAGE_OVERHEAD_BYTES for its role and markup."""
        if samples and passthrough.caller_request(samples[0]) is not None:  # a gateway's batch
            return sum(len(passthrough.input_text(s).encode()) for s in samples
                       if passthrough.caller_request(s) is not None)
        calls = [[samples[i] for i in call] for call in self.split(samples)]
        return sum(len(m["content"].encode()) + MESSAGE_OVERHEAD_BYTES
                   for call in calls for m in self.call_messages(call))

    def url(self, samples: list[dict]) -> str:
        """The chat endpoint, or for a gateway's text completion `{url}/completions`."""
        if passthrough.call_request(samples) is None or \
                passthrough.endpoint(samples[0]) != passthrough.COMPLETIONS:
            return self.endpoint
        if self.text_endpoint is None:
            raise PermanentError(f"the {self.dialect.name} dialect has no text completions "
                                 "endpoint (POST /v1/completions needs an openai or azure judge)")
        return self.text_endpoint

    def request(self, samples: list[dict]) -> dict:
        if (body := passthrough.call_request(samples)) is not None:
            return passthrough.payload(body, self.options.model)
        payload: dict[str, Any] = {
            "model": self.options.model,
            "messages": self.call_messages(samples),
            # group mode: max_tokens per response, so the reply has room for every score
            "max_tokens": self.options.max_tokens * len(samples),
            "temperature": 0,
        }
        if self.options.structured:
            payload["response_format"] = _verdict_format(len(samples) if self.grouped else None)
        vote = samples[0].get("vote") if len(samples) == 1 else None
        if vote and "temperature" in vote:  # an ensemble's judge asked again: another draw
            payload.update(temperature=vote["temperature"], seed=vote["index"])
        return self.wire_request(samples, payload)

    def wire_request(self, samples: list[dict], chat: dict) -> dict:
        """The body the provider gets for the OpenAI chat body `chat`: in its dialect, with
        the call's priority when the server schedules by it (`priority_field`)."""
        body = self.dialect.body(chat)
        level = samples[0].get(CALL_LEVEL) if self.options.priority_field else None
        if level is not None:  # vLLM: lower first, as qrq's levels (val 0, train 6, bulk 9)
            body["priority"] = level
        return body

    def reply_text(self, reply: Reply) -> str:
        """The judge's text in the provider's reply, or the error naming what it lacks."""
        try:
            return self.dialect.text(reply.body)
        except PermanentError as exc:
            raise PermanentError(str(exc), exc.detail, status_code=reply.status_code,
                                 headers=reply.headers) from None

    def answer(self, samples: list[dict], reply: Reply) -> Call:
        if passthrough.call_request(samples) is not None:
            return passthrough.answer(reply)
        content = self.reply_text(reply)
        facts: dict[str, Any] = {"status_code": reply.status_code, "headers": reply.headers}
        responses = [s["response"] for s in samples]
        scores = self.parse_group(content, responses) if self.grouped \
            else self.parse_score(content, responses[0])
        if isinstance(scores, PermanentError):
            raise PermanentError(str(scores), scores.detail, **facts)
        return Call(
            scores if isinstance(scores, list) else [scores], usage_tokens(reply.body),
            reply.status_code, reply.headers,
            [flag(injection.detect(r), content[:500]) for r in responses],
            usage_split(reply.body),
        )

    def parse_group(self, content: str, responses: Sequence[str]
                    ) -> list[float | ScoringError] | PermanentError:
        """One score per response of the group, or the group's error quoting the reply."""
        verdict = _json_verdict(content, "scores") if self.options.structured else None
        if verdict is not None:
            content = json.dumps(verdict)
        pattern = self.options.group_pattern
        try:
            if pattern is not None:  # tagged scores: the judge's own, not those a response wrote
                own = own_matches(list(re.finditer(pattern, content)), responses, content)
                content = "\n".join(m.group(0) for m in own)
            return list(groups.parse_group_scores(
                content, len(responses), pattern, self.options.score_range))
        except PermanentError as exc:
            return exc

    def parse_score(self, content: str, response: str = "") -> float | PermanentError:
        """The judge's own score in its reply: its JSON verdict (`structured`), else per
        `score_pattern` and `score_match` among the matches that do not quote `response`."""
        verdict = _json_verdict(content, "score") if self.options.structured else None
        if verdict is not None:
            return checked_score(verdict, self.options.score_range, f"score {verdict!r}",
                                 content[:500])
        matches = list(self.pattern.finditer(content))
        if not matches:
            return PermanentError(
                f"no score in the judge's reply (pattern {self.pattern.pattern!r})", content[:500]
            )
        found = [m.group(1) for m in own_matches(matches, [response], content)]
        if not found:
            return PermanentError(
                "no score of the judge's own in its reply (each one quotes the response)",
                content[:500],
            )
        policy = self.options.score_match
        if policy == "unique" and len(set(map(_number_or_text, found))) > 1:
            return PermanentError(
                f"{len(found)} different scores in the judge's reply ({', '.join(found[:5])}); "
                'set score_match = "first" or "last" to pick one',
                content[:500],
            )
        text = found[-1] if policy == "last" else found[0]
        return checked_score(text, self.options.score_range, f"score {text!r}", content[:500])


def own_matches(matches: list[re.Match[str]], responses: Sequence[str], content: str
                ) -> list[re.Match[str]]:
    """The matches that are the judge's own, not its quotes of `responses`.

    A match whose text appears in a response is a quote. When every match is one, the last
    is still the judge's verdict (judges write it last; a response holding every possible
    score line cannot unscore itself), unless its line and the line before appear together
    in a response: then the reply ends in a quote and holds no verdict of the judge's own.
    """
    own = [m for m in matches if not any(m.group(0) in r for r in responses)]
    if own or not matches:
        return own
    last = matches[-1]
    start = content.rfind("\n", 0, max(0, content.rfind("\n", 0, last.start())))
    end = content.find("\n", last.end())
    window = content[start + 1:end if end >= 0 else len(content)].strip()
    quoted = window != last.group(0).strip() and any(window in r for r in responses)
    return [] if quoted else [last]


def _verdict_format(count: int | None) -> dict[str, Any]:
    """`response_format`: a JSON schema of the verdict, {"score": x} or {"scores": [...]}."""
    key, value = ("score", {"type": "number"}) if count is None else (
        "scores", {"type": "array", "items": {"type": "number"}, "minItems": count,
                   "maxItems": count})
    schema = {"type": "object", "properties": {key: value}, "required": [key],
              "additionalProperties": False}
    return {"type": "json_schema",
            "json_schema": {"name": "verdict", "strict": True, "schema": schema}}


def _json_verdict(content: str, key: str) -> Any:
    """`key` of the reply when it is the JSON verdict `response_format` asked for, else None
    (a server that ignored the schema: the text is read as usual). A key given twice is
    the list of its values, which no score reads as a number."""
    text = content.strip().removeprefix("```json").strip("`\n ")
    try:
        pairs = json.loads(text, object_pairs_hook=list)
    except (ValueError, RecursionError):
        return None
    if not text.startswith("{"):
        return None
    values = [value for name, value in pairs if name == key]
    return None if not values else values[0] if len(values) == 1 else values


def _group_options(b: Table) -> dict[str, Any]:
    """`mode` and, in group mode, its keys (each refused in sample mode, naming it)."""
    mode = b.get("mode", str, "sample")
    if mode not in MODES:
        raise b.fail("mode", f"one of {', '.join(MODES)}")
    if mode == "sample":
        for key in _GROUP_KEYS:
            if key in b.data:
                b.used.add(key)
                b.note(ConfigError(f'{b.where(key)}: only read with mode = "group"'))
        return {"mode": mode, **{key: getattr(JudgeOptions, key) for key in _GROUP_KEYS}}
    values: dict[str, Any] = {
        "mode": mode,
        "group_template": b.get("group_template", str, groups.DEFAULT_GROUP_TEMPLATE),
        "group_max": b.integer("group_max", JudgeOptions.group_max),
        "group_pattern": b.get("group_pattern", str, None,
                               expected="a regex with two capture groups: response number, score"),
    }
    problem = groups.template_problem(values["group_template"])
    if problem:
        raise b.fail("group_template", problem)
    if values["group_pattern"] is not None:
        problem = groups.pattern_problem(values["group_pattern"])
        if problem:
            raise b.fail("group_pattern", problem)
    return values


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
