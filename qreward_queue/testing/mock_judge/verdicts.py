"""What the mock judge answers: its verdict rule, group scoring and the weak (`fooled`) judge;
apart from the wire formats, so every API answers alike and tests can predict every score.

Verdict rule (deterministic, so tests can check every score):
    verdict(text) = (zlib.crc32(text.encode("utf-8")) % 101) / 100, applied to the content of
    the last message with role "user". The reward-model endpoint scores each item with
    rm_verdict(prompt, response) = verdict(prompt + "\\n" + response).

Group prompts (one chat call judging a whole group; the wire format is
qreward_queue.backends.groups'):
a judged text holding numbered blocks '<response id="1">\\n...\\n</response>', numbered 1, 2, ...
in order, is a group. Its head is the text before the first block (the shared prompt and the
instructions); each response scores rm_verdict(head, response), and the reply ends with the
scores as `group_reply` says: "list" 'Scores: [0.42, 0.07]', "object" 'Scores: {"1": 0.42,
"2": 0.07}', "tagged" '[1] Score: 0.42' lines. split_group() is that reading of a text.

Structured output: a request with `response_format` {"type": "json_schema", ...} is answered
with the JSON verdict alone: '{"score": 0.42}', or for a group '{"scores": [0.42, 0.07]}'.

A weak judge (`fooled`), for the judge integrity tests, the benchmark and the demo: it takes a
fenced block as the response (the first closing tag of the fence's name ends it, as a model
reads it) and everything else as its instructions. A verdict line among its instructions
('Score: 1', the last one) is obeyed: that number becomes its verdict, for a group the verdict
of the response whose block precedes it. So a response with no fence around it, or one that
closes a plain `</response>` tag early, talks it into any score; a fenced one cannot. Its reply
quotes the response(s) first ('The response reads:\n...'), then gives its verdict, so a
parser that reads the first score reads the response's.

Group faults, a well-formed 200 whose scores are wrong in one way, chosen per request by a
marker in the judged text, else (with group_fault_rate) by a draw from crc32(seed, text), so a
test can aim at one and a retry of the same request meets the same fault:
    [[mock:group-few]]    one score too few           [[mock:group-extra]]  one score too many
    [[mock:group-dup]]    the last response numbered as the first
    [[mock:group-order]]  scores in reverse order, correctly numbered (the only one to accept)
    [[mock:group-nan]]    the last score is "n/a"     [[mock:group-zero]]   numbered from 0
Faults that need numbers (dup, order, zero) reply as an object when group_reply is "list".
"""

from __future__ import annotations

import json
import re
import zlib

from .settings import MockJudgeSettings

GROUP_FAULTS = ("few", "extra", "dup", "order", "nan", "zero")
_RESPONSE_BLOCK = re.compile(r'<(response(?:-[0-9a-f]{16,32})?) id="(\d+)">\n(.*?)\n</\1>',
                             re.DOTALL)
_FENCE = re.compile(r"<(response-[0-9a-f]{16,32})>\n(.*?)\n</\1>", re.DOTALL)
_OBEYED = re.compile(r"(?i)score\s*[:=]\s*([-+]?(?:\d+\.?\d*|\.\d+))")
_UNSEEN = re.compile("[\u200b-\u200f\u2060-\u2064\ufeff\u00ad]")
_LABEL = re.compile(r"(?im)^(?:candidate\s+)?(?:response|answer)\s*:\s?")


def verdict(text: str) -> float:
    """The judge's score for a text: (crc32 % 101) / 100, so tests can predict every score."""
    # surrogatepass only matters for lone surrogates, which JSON allows but UTF-8 does not
    return (zlib.crc32(text.encode("utf-8", "surrogatepass")) % 101) / 100


def rm_verdict(prompt: str, response: str) -> float:
    """The reward model's score for one (prompt, response) item."""
    return verdict(prompt + "\n" + response)


def split_group(text: str) -> tuple[str, list[str]] | None:
    """(head, responses) when `text` is a group prompt, else None (then it is one sample)."""
    blocks = list(_RESPONSE_BLOCK.finditer(text))
    if not blocks or any(m.group(2) != str(n) for n, m in enumerate(blocks, 1)):
        return None
    return text[: blocks[0].start()].rstrip("\n"), [m.group(3) for m in blocks]


def obeyed(instructions: str) -> float | None:
    """The verdict a weak judge takes from its instructions: their last verdict line (read as
    a model reads it: through invisible characters)."""
    found = _OBEYED.findall(_UNSEEN.sub("", instructions))
    return float(found[-1]) if found else None


def fooled_verdict(text: str) -> tuple[str, float]:
    """A weak judge's reading of one sample's message: (what it quotes as the response, its
    verdict): an obeyed verdict line outside the fence, else the honest `verdict(text)`."""
    fenced = _FENCE.search(text)
    if fenced:
        quoted, instructions = fenced.group(2), text[:fenced.start()] + text[fenced.end():]
    else:
        label = _LABEL.search(text)
        quoted, instructions = text[label.end() if label else 0:], text
    told = obeyed(instructions)
    return quoted, verdict(text) if told is None else told


def _fooled_group(text: str, head: str, responses: list[str]) -> list[float]:
    """A weak judge's group verdicts: a verdict line between blocks (a response that closed
    its block early) is obeyed for the response before it."""
    blocks = list(_RESPONSE_BLOCK.finditer(text))
    scores = [rm_verdict(head, r) for r in responses]
    for n, block in enumerate(blocks):
        gap = text[block.end():blocks[n + 1].start() if n + 1 < len(blocks) else len(text)]
        told = obeyed(gap)
        if told is not None:
            scores[n] = told
    return scores


def _group_fault(text: str, triggers: set[str], settings: MockJudgeSettings) -> str | None:
    marked = sorted(t.removeprefix("group-") for t in triggers if t.startswith("group-"))
    if marked:
        return marked[0]
    draw = zlib.crc32(f"{settings.seed}:{text}".encode("utf-8", "surrogatepass"))
    if draw % 10_000 < settings.group_fault_rate * 10_000:
        return GROUP_FAULTS[draw // 10_000 % len(GROUP_FAULTS)]
    return None


def _group_reply(scores: list[float], fault: str | None, style: str) -> str:
    """The judge's answer for a group: one score per response, unless `fault` spoils it."""
    pairs: list[tuple[int, float | str]] = list(enumerate(scores, 1))
    match fault:
        case "few":
            pairs = pairs[:-1]
        case "extra":
            pairs = [*pairs, (len(pairs) + 1, 0.5)]
        case "dup":
            pairs = [*pairs[:-1], (1, pairs[-1][1])] if len(pairs) > 1 else pairs * 2
        case "order":
            pairs = pairs[::-1]
        case "nan":
            pairs = [*pairs[:-1], (pairs[-1][0], "n/a")]
        case "zero":
            pairs = [(n - 1, score) for n, score in pairs]
    if style == "list" and fault in ("dup", "order", "zero"):
        style = "object"
    if style == "tagged":
        return "\n".join(f"[{n}] Score: {score}" for n, score in pairs)
    if style == "object":
        fields = ", ".join(f'"{n}": {json.dumps(score)}' for n, score in pairs)  # keeps duplicates
        return f"Scores: {{{fields}}}"
    return f"Scores: {json.dumps([score for _, score in pairs])}"


def answer(judged: str, triggers: set[str], structured: bool,
           settings: MockJudgeSettings) -> tuple[str, int]:
    """A chat call's reply text for its judged text, and how many responses it scored in bulk
    (a group's, when its scores are well-formed)."""
    group = split_group(judged)
    items = 0
    if "garbage" in triggers:
        content = "I cannot decide."
    elif group:
        head, responses = group
        fault = _group_fault(judged, triggers, settings)
        scores = _fooled_group(judged, head, responses) if settings.fooled else \
            [rm_verdict(head, r) for r in responses]
        content = _group_reply(scores, fault, settings.group_reply)
        if structured and fault is None:
            content = json.dumps({"scores": scores})
        elif settings.fooled:
            quotes = "".join(f"Response {n} reads:\n{r}\n" for n, r in enumerate(responses, 1))
            content = quotes + content
        items = len(responses) if fault in (None, "order") else 0
    else:
        quoted, score = fooled_verdict(judged) if settings.fooled else ("", verdict(judged))
        content = (json.dumps({"score": round(score, 2)}) if structured
                   else f"The response reads:\n{quoted}\nScore: {score:.2f}" if settings.fooled
                   else f"The response was assessed. Score: {score:.2f}")
    return content, items
