"""Format rewards: the response's tag structure, minus length and repetition penalties.

`format_reward(sample)` is 1.0 when the response is exactly the configured tags in order
(default `<think>...</think><answer>...</answer>`, each tag once, whitespace between them
allowed), else 0.0; then
- an overlong penalty (DAPO style): 0 up to `soft_chars`, growing linearly to
  `overlong_penalty` at `max_chars` and staying there;
- a repetition penalty: `repetition_penalty` x the share of repeated word n-grams.
One compiled regex and one pass over the words: tens of thousands of responses per second.

Example (as a function backend, options go to [backend.options]):
    >>> format_reward({"prompt": "", "response": "<think>hm</think> <answer>4</answer>"})
    1.0
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

DEFAULT_TAGS = ("think", "answer")


@lru_cache(maxsize=64)
def tag_finder(tags: tuple[str, ...]) -> re.Pattern[str]:
    """A regex finding every opening or closing tag among `tags`."""
    if not tags or not all(re.fullmatch(r"[A-Za-z][\w-]*", t) for t in tags):
        raise ValueError(f"format_reward: tags must be non-empty tag names, got {list(tags)!r}")
    return re.compile("</?(?:" + "|".join(map(re.escape, tags)) + ")>")


def has_structure(text: str, tags: tuple[str, ...]) -> bool:
    """True when `text` is exactly `<t1>...</t1> <t2>...</t2> ...`: each tag once, in order,
    nothing but whitespace outside them (one linear scan, no backtracking)."""
    found = list(tag_finder(tags).finditer(text))
    if [m.group() for m in found] != [t for tag in tags for t in (f"<{tag}>", f"</{tag}>")]:
        return False
    outside = [text[: found[0].start()], text[found[-1].end() :]]
    outside += [text[found[i].end() : found[i + 1].start()] for i in range(1, len(found) - 1, 2)]
    return not any(part.strip() for part in outside)


def repetition(text: str, n: int = 4) -> float:
    """Share of word n-grams that repeat an earlier one (0: none, near 1: a loop)."""
    words = text.split()
    grams = len(words) - n + 1
    if grams <= 1:
        return 0.0
    return 1.0 - len(set(zip(*(words[i:] for i in range(n)), strict=False))) / grams


def overlong(length: int, soft_chars: int | None, max_chars: int | None) -> float:
    """0 up to soft_chars, 1 from max_chars, linear between (both None: never)."""
    if max_chars is None:
        return 0.0
    soft = max_chars if soft_chars is None else soft_chars
    if length <= soft:
        return 0.0
    if length >= max_chars or max_chars <= soft:
        return 1.0
    return (length - soft) / (max_chars - soft)


def format_reward(
    sample: dict,
    tags: Sequence[str] = DEFAULT_TAGS,
    score: float = 1.0,
    max_chars: int | None = None,
    soft_chars: int | None = None,
    overlong_penalty: float = 1.0,
    repetition_penalty: float = 0.0,
    ngram: int = 4,
) -> float:
    """`score` when the tag structure is right (else 0.0), minus the penalties."""
    text = sample["response"]
    value = score if has_structure(text, tuple(tags)) else 0.0
    value -= overlong_penalty * overlong(len(text), soft_chars, max_chars)
    if repetition_penalty:
        value -= repetition_penalty * repetition(text, ngram)
    return value
