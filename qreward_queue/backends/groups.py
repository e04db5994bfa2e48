"""Group judging: one judge call scores every response of a GRPO group, relative to each other.

Pure functions, no Redis and no HTTP, so the call path can use them wherever a group travels:

    plan_groups(samples, max_size)   -> [[input index, ...], ...]   whole groups, balanced splits
    render_group(template, samples)  -> the user message: shared prompt once, responses numbered
    parse_group_scores(reply, count) -> one score per response, or a PermanentError quoting it

The wire format. `{responses}` in a group template becomes one block per response, numbered
from 1 in the order of the group:

    <response-3f1c0e9a27b4d865 id="1">
    first response text
    </response-3f1c0e9a27b4d865>

Tags rather than "[1] ..." lines, so a response may hold any text, newlines included; the tag's
name is `injection.fence` of the group's responses, which none of them can close (a response
holding `</response>` does not end its block), and a note after the blocks tells the judge
that what is inside them is only text to grade. `fenced=False` writes plain `<response>`
tags (the judge integrity benchmark's "fence off"). The judge
answers with a JSON list (scores in response order) or a JSON object keyed by response number
at the end of its reply, or, with a `score_pattern` of two capture groups (number, score), with
tagged scores such as "[2] Score: 0.7". A reply that does not give exactly one valid score per
response is an error for the whole group; a group is never scored in part.

How the call path is meant to use it (a backend file with `mode = "group"`): the planner cuts
chunks out of whole `plan_groups` entries only; the judge kind's call renders one message per
group, estimates its TPM cost from that message plus max_tokens, and maps its reply with
`parse_group_scores(reply, len(group), pattern, score_range)`. The PermanentError it raises
becomes every sample's outcome of that group (Outcome.failed); retries, failover and the breaker
see one call. The config loader checks a backend's keys with `template_problem` and
`pattern_problem`.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import InvalidSamples, PermanentError
from . import injection
from .base import checked_score

DEFAULT_GROUP_TEMPLATE = (
    "Rate each of the {count} responses to the prompt on a scale from 0 to 1, comparing them "
    "with each other.\nPrompt: {prompt}\nReference: {reference}\n{responses}\n"
    "Answer with a JSON list of {count} scores, one per response in order."
)
# tagged scores: the response number, then its score (any token, so "n/a" is named, not skipped)
DEFAULT_TAGGED_PATTERN = (
    r"\[(\d+)\]\s*Score:\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[^\s,;]+)"
)
RESPONSE_BLOCK = '<{tag} id="{number}">\n{response}\n</{tag}>'
_QUOTE_HEAD, _QUOTE_TAIL = 150, 350  # a long reply's detail keeps both ends: scores come last


def group_indices(samples: Sequence[Mapping[str, Any]]) -> list[list[int]]:
    """Input indices grouped by the sample's `group` key, else by identical prompt.

    Groups come in the order of their first sample, indices ascending, so a plan is stable
    from one run to the next. A `group` shared by samples with different prompts cannot be
    rendered with its prompt once: that is bad input, named per sample.

    >>> group_indices([{"prompt": "a"}, {"prompt": "b"}, {"prompt": "a"}])
    [[0, 2], [1]]
    >>> group_indices([{"prompt": "a", "group": 7}, {"prompt": "a"}, {"prompt": "a", "group": 7}])
    [[0, 2], [1]]
    """
    groups: dict[tuple[str, Any], list[int]] = {}
    problems: dict[int, str] = {}
    for i, sample in enumerate(samples):
        group = sample.get("group")
        if group is None:
            key: tuple[str, Any] = ("prompt", sample["prompt"])
        elif isinstance(group, bool) or not isinstance(group, (str, int)):
            kind = type(group).__name__
            problems[i] = f"field 'group' must be a string or an integer, got {kind}"
            continue
        else:
            key = ("group", group)
        members = groups.setdefault(key, [])
        if members and samples[members[0]]["prompt"] != sample["prompt"]:
            problems[i] = (f"group {group!r} has another prompt than sample {members[0]} "
                           "(a group shares one prompt)")
            continue
        members.append(i)
    if problems:
        raise InvalidSamples(problems)
    return list(groups.values())


def split_balanced(indices: Sequence[int], max_size: int) -> list[list[int]]:
    """`indices` in as few consecutive sub-groups of at most `max_size` as possible, their
    sizes differing by at most one (a 9-group under 8 is 5 + 4, never 8 + 1: a lone response
    has nothing to be compared with).

    >>> split_balanced(range(9), 8)
    [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
    >>> [len(g) for g in split_balanced(range(20), 8)]
    [7, 7, 6]
    """
    if max_size < 1:
        raise ValueError(f"max_size must be at least 1, got {max_size}")
    indices = list(indices)
    parts = max(1, math.ceil(len(indices) / max_size))
    size, bigger = divmod(len(indices), parts)
    bounds = [i * size + min(i, bigger) for i in range(parts + 1)]
    return [indices[start:end] for start, end in itertools.pairwise(bounds)]


def plan_groups(samples: Sequence[Mapping[str, Any]], max_size: int) -> list[list[int]]:
    """The groups the judge sees: `group_indices`, each split to at most `max_size` responses.
    The call path treats each as one unit (one call, one retry, one failover)."""
    return [part for group in group_indices(samples) for part in split_balanced(group, max_size)]


def render_group(template: str, samples: Sequence[Mapping[str, Any]], fenced: bool = True
                 ) -> str:
    """The user message for one group, from a template with the fields of a judge template
    (`{prompt}`, `{reference}`, `{data_source}`, `{extra}`: the group's first sample's) plus
    `{responses}` (the numbered blocks) and `{count}`.

    >>> group = [{"prompt": "2+2?", "response": "4"}, {"prompt": "2+2?", "response": "5"}]
    >>> print(render_group("Q: {prompt}\\n{responses}", group, fenced=False))
    Q: 2+2?
    <response id="1">
    4
    </response>
    <response id="2">
    5
    </response>
    """
    first = samples[0]
    texts = [s["response"] for s in samples]
    tag = injection.fence(texts) if fenced else "response"
    responses = "\n".join(
        RESPONSE_BLOCK.format(tag=tag, number=n, response=text) for n, text in enumerate(texts, 1)
    )
    if fenced:
        responses += "\n" + injection.fence_note(tag, group=True)
    return template.format(
        prompt=first["prompt"],
        reference=first.get("reference") or "",
        data_source=first.get("data_source") or "",
        extra=first.get("extra") or {},
        responses=responses,
        count=len(samples),
    )


def pattern_problem(pattern: str) -> str | None:
    """Why `pattern` cannot read tagged scores (for the config loader), or None."""
    try:
        groups = re.compile(pattern).groups
    except re.error as exc:
        return f"a valid regex ({exc})"
    return None if groups == 2 else "a regex with two capture groups: response number, score"


def template_problem(template: str) -> str | None:
    """Why `template` cannot be a group template (for the config loader), or None."""
    if "{responses}" not in template:
        return "a group template needs {responses}, where the numbered responses go"
    try:
        render_group(template, [{"prompt": "", "response": ""}])
    except Exception as exc:  # str.format can raise almost anything on a bad template
        return f"a valid format string with the judge template's fields ({exc!r})"
    return None


def parse_group_scores(
    reply: str,
    count: int,
    pattern: str | None = None,
    score_range: tuple[float, float] | None = None,
) -> list[float]:
    """Exactly one score per response of a `count`-group, in response order.

    Without `pattern`, the reply must end with a JSON list (position = response) or a JSON
    object keyed by response number (a closing code fence may follow). With `pattern` (two
    capture groups: number, score), every match is one tagged score. Too few, too many,
    duplicate or unknown numbers, non-numbers, non-finite scores and scores outside
    `score_range` raise PermanentError (an `error` for every sample of the group) whose detail
    quotes the reply.

    >>> parse_group_scores("Scores: [0.2, 0.9]", 2)
    [0.2, 0.9]
    >>> parse_group_scores('{"2": 1, "1": 0}', 2)
    [0.0, 1.0]
    >>> parse_group_scores("[2] Score: 0.5\\n[1] Score: 0.25", 2, DEFAULT_TAGGED_PATTERN)
    [0.25, 0.5]
    """
    if pattern is None:
        opener, value = _trailing_json(reply)
        if opener is None:
            raise _bad(reply, "the judge's reply does not end with a JSON list or object of scores")
        if opener == "[" and len(value) != count:
            raise _bad(reply, f"the judge's reply gives {len(value)} scores for {count} responses")
        pairs = [(str(n), score) for n, score in enumerate(value, 1)] if opener == "[" else value
    else:
        pairs = [(m.group(1), m.group(2)) for m in re.finditer(pattern, reply)]
    return _one_per_response(pairs, count, score_range, reply)


def _trailing_json(reply: str) -> tuple[str | None, Any]:
    """("[", the JSON list) or ("{", the JSON object as [key, value] pairs, duplicates kept)
    that ends `reply`, or (None, None). The first opener that decodes to the end is the
    outermost value, so "Scores: [0.1, 0.2]" and a ```json fence both work."""
    text = reply.rstrip().removesuffix("```").rstrip()
    decoder = json.JSONDecoder(object_pairs_hook=list)
    for start in (i for i, char in enumerate(text) if char in "[{"):
        try:
            value, end = decoder.raw_decode(text, start)
        except (ValueError, RecursionError):
            continue
        if end == len(text):
            return text[start], value
    return None, None


def _one_per_response(
    pairs: Sequence[Any], count: int, score_range: tuple[float, float] | None, reply: str
) -> list[float]:
    scores: dict[int, float] = {}
    for number_text, value in pairs:
        number = _response_number(number_text)
        if number is None or not 1 <= number <= count:
            raise _bad(reply, f"the judge's reply scores response {number_text!r}, "
                              f"not one of 1..{count}")
        if number in scores:
            raise _bad(reply, f"the judge's reply scores response {number} twice")
        score = checked_score(value, score_range, f"the score of response {number} ({value!r})")
        if isinstance(score, PermanentError):
            raise _bad(reply, str(score))
        scores[number] = score
    missing = [n for n in range(1, count + 1) if n not in scores]
    if missing:
        listed = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
        raise _bad(reply, f"the judge's reply gives {len(scores)} scores for {count} responses "
                          f"(none for response {listed})")
    return [scores[n] for n in range(1, count + 1)]


def _response_number(text: Any) -> int | None:
    return int(text) if isinstance(text, str) and text.strip().isdecimal() else None


def _bad(reply: str, why: str) -> PermanentError:
    """The group's error, quoting the reply (both ends of a long one) for the outcome's detail."""
    if len(reply) > _QUOTE_HEAD + _QUOTE_TAIL:
        reply = f"{reply[:_QUOTE_HEAD]} [...] {reply[-_QUOTE_TAIL:]}"
    return PermanentError(why, reply)
