"""Math answers: extract the final answer, compare it cheaply, then with math-verify.

`math_reward(sample)` is 1.0 when the response's final answer equals the reference, else 0.0.
1. Extraction: the last `\\boxed{...}` (or `\\fbox{...}`), else the text after the last `####`
   (GSM8K), else after "the answer is", else the last number.
2. A fast path: the two answers equal as normalised strings or as numbers (commas, `\\frac`,
   `a/b`, percents, LaTeX spacing and `$` removed) -> 1.0 without any parser.
3. Otherwise math-verify (`pip install "qreward-queue[rewards]"`) decides equivalence
   (fractions vs decimals, expressions, sets, intervals...). Without it the fast path decides.
A reference nothing can be read from raises ValueError: the sample is an `error` with that
reason, never a silent 0. math-verify's own timeouts use SIGALRM, which works only in a main
thread; qrq runs function backends in helper processes, so they work there, and in other
threads they are switched off (the backend's per-sample limit still holds).

Example:
    >>> math_reward({"prompt": "1/2 + 1/4?", "response": "So \\\\boxed{3/4}.", "reference": "0.75"})
    1.0
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASHES = "####"
_ANSWER_IS = re.compile(r"answer is[:\s]*", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")
_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*([-+]?[\d.]+)\s*\}\s*\{\s*([-+]?[\d.]+)\s*\}")
_SPACING = re.compile(r"\\[,;:! ]|\\left|\\right|\\displaystyle|\s+")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf)\s*\{([^{}]*)\}")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...}, braces matched; None when absent."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None  # unclosed: the response was cut off


def extract_answer(text: str) -> str | None:
    """The final answer of a solution text, by the rules in the module docstring."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if _HASHES in text:
        tail = text.rsplit(_HASHES, 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else None
    said = list(_ANSWER_IS.finditer(text))
    if said:
        rest = text[said[-1].end() :].strip().splitlines()
        if rest and rest[0].strip():
            return rest[0].strip().rstrip(".")
    numbers = _NUMBER.findall(text.replace(",", ""))
    return numbers[-1] if numbers else None


def normalize(answer: str) -> str:
    """A canonical string: no `$`, LaTeX spacing, \\text{} wrappers, trailing period."""
    answer = _TEXT.sub(r"\1", answer.replace("$", ""))
    answer = _FRAC.sub(r"\1/\2", answer)
    answer = _SPACING.sub("", answer).replace("\\%", "%").rstrip(".")
    if answer.startswith("{") and answer.endswith("}"):
        answer = answer[1:-1]
    return answer


def as_number(answer: str) -> Fraction | None:
    """The answer as an exact number (`1,000`, `3/4`, `0.75`, `75%`), or None."""
    text = normalize(answer).replace(",", "")
    percent = text.endswith("%")
    text = text.rstrip("%")
    if not _NUMBER.fullmatch(text):
        return None
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None
    return value / 100 if percent else value


def fast_equal(predicted: str, gold: str) -> bool:
    """Equal as normalised strings or as numbers (relative tolerance 1e-6)."""
    if normalize(predicted) == normalize(gold):
        return True
    a, b = as_number(predicted), as_number(gold)
    if a is None or b is None:
        return False
    return abs(a - b) <= Fraction(1, 10**6) * max(Fraction(1), abs(b))


def _math_verify():
    try:
        import math_verify
    except ImportError:
        return None
    return math_verify


def gold_answer(reference: str) -> str:
    """The answer held by a reference (a bare answer or a full solution); ValueError if none."""
    if not reference.strip():
        raise ValueError("math_reward: the sample's 'reference' is empty")
    if last_boxed(reference) is not None or _HASHES in reference:
        found = extract_answer(reference)
        if not found:
            raise ValueError(f"math_reward: no answer in reference {reference[:200]!r}")
        return found
    return reference.strip()


def math_reward(sample: dict, use_math_verify: bool = True, timeout_s: int = 5) -> float:
    """1.0 when the response's final answer equals the reference's, else 0.0."""
    reference = sample.get("reference")
    if reference is None:
        raise ValueError("math_reward needs the sample's 'reference'")
    gold = gold_answer(reference)
    predicted = extract_answer(sample["response"])
    if predicted is not None and fast_equal(predicted, gold):
        return 1.0
    mv = _math_verify() if use_math_verify else None
    if mv is None:
        if as_number(gold) is None and not normalize(gold):
            raise ValueError(f"math_reward: cannot read reference {reference[:200]!r}")
        return 0.0
    timeout = timeout_s if threading.current_thread() is threading.main_thread() else None
    gold_parsed = mv.parse(gold, parsing_timeout=timeout) or mv.parse(
        f"${gold}$", parsing_timeout=timeout
    )
    if not gold_parsed:
        raise ValueError(f"math_reward: math-verify cannot parse reference {reference[:200]!r}")
    boxed = last_boxed(sample["response"])
    target = f"${boxed}$" if boxed is not None else sample["response"]
    parsed = mv.parse(target, parsing_timeout=timeout)
    return 1.0 if parsed and mv.verify(gold_parsed, parsed, timeout_seconds=timeout) else 0.0
