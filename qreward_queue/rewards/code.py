"""Code execution: run the response's program against test cases in a sandbox; the score is
the fraction of cases passed.

Test cases come from `sample["extra"]["tests"]`, else from `sample["reference"]` as JSON, in
the shapes of the usual data sets:
- a list of cases: `{"input": "1 2\\n", "output": "3\\n"}` (stdin/stdout) or
  `{"fn_name": "add", "args": [1, 2], "expected": 3}` (call-based; a top-level function or
  a method of LeetCode's `class Solution`);
- TACO / APPS / code-r1 `input_output`: `{"inputs": [...], "outputs": [...]}` plus an
  optional `"fn_name"` (then each input is the argument list).
The program is the last ```python fenced block of the response (else the whole response).
All cases of one sample run in ONE sandbox (`sandbox.run_cases`: one process, a fork per
case), which is what makes thousands of samples per minute possible. Expected outputs stay
outside the sandbox; stdout is compared line by line with trailing whitespace ignored, and
numbers within 1e-6. A program that hangs is stopped at `case_s` and its remaining cases are
skipped: `code_reward` then raises SampleTimeout (the sample's status is `timeout`, with the
case named), `run_tests` counts them as failed.

Example:
    >>> code_reward({"prompt": "", "response": "print(int(input()) * 2)",
    ...              "extra": {"tests": [{"input": "2", "output": "4"}]}})
    1.0
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from ..errors import SampleTimeout
from .sandbox import Limits, Run, run_cases

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(response: str) -> str:
    """The last fenced Python block of a response, else the response itself."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def load_tests(sample: dict) -> list[dict]:
    """The sample's test cases as a list of case dicts; ValueError naming what is wrong."""
    raw: Any = (sample.get("extra") or {}).get("tests")
    if raw is None:
        reference = sample.get("reference")
        if reference is None:
            raise ValueError("code_reward needs test cases in extra['tests'] or 'reference'")
        try:
            raw = json.loads(reference)
        except ValueError as exc:
            raise ValueError(f"code_reward: 'reference' is not JSON test cases ({exc})") from None
    if isinstance(raw, dict):  # TACO / APPS input_output
        inputs, outputs = raw.get("inputs"), raw.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list):
            raise ValueError("code_reward: test cases need lists 'inputs' and 'outputs'")
        if len(inputs) != len(outputs):
            raise ValueError(f"code_reward: {len(inputs)} inputs but {len(outputs)} outputs")
        name = raw.get("fn_name")
        raw = [
            {"fn_name": name, "args": i, "expected": o} if name else {"input": i, "output": o}
            for i, o in zip(inputs, outputs, strict=True)
        ]
    if not isinstance(raw, list) or not raw:
        raise ValueError("code_reward: no test cases")
    for k, case in enumerate(raw):
        if not isinstance(case, dict) or not (
            {"input", "output"} <= set(case) or "fn_name" in case
        ):
            raise ValueError(f"code_reward: test case {k} is neither stdin/stdout nor call-based")
    return raw


def _same_token(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-6)


def same_output(got: str, want: str) -> bool:
    """Equal line by line, trailing whitespace and blank lines ignored, numbers within 1e-6."""
    lines = [line.rstrip() for line in got.strip().splitlines()]
    expected = [line.rstrip() for line in str(want).strip().splitlines()]
    if lines == expected:
        return True
    tokens, wanted = " ".join(lines).split(), " ".join(expected).split()
    return len(tokens) == len(wanted) and all(map(_same_token, tokens, wanted))


def passed(case: dict, outcome: dict) -> bool:
    """Did the program pass this case?"""
    if outcome.get("status") != "ok":
        return False
    if "fn_name" not in case:
        return same_output(outcome.get("stdout", ""), case["output"])
    try:
        value = json.loads(outcome.get("result", ""))
    except ValueError:
        return False
    want = case.get("expected")
    # TACO wraps a call's expected value in a one-element list
    return value == want or (isinstance(want, list) and len(want) == 1 and value == want[0])


def _as_args(args: Any) -> list:
    return args if isinstance(args, list) else [args]


def run_tests(sample: dict, limits: Limits = Limits(), unsafe: bool = False) -> tuple[float, Run]:  # noqa: B008
    """(fraction passed, the sandbox run with every case's outcome) for one sample."""
    cases = load_tests(sample)
    inputs = [
        {"fn_name": c["fn_name"], "args": _as_args(c.get("args", []))}
        if "fn_name" in c
        else {"input": str(c["input"])}
        for c in cases
    ]
    run = run_cases(extract_code(sample["response"]), inputs, limits, unsafe=unsafe)
    ok = sum(passed(c, o) for c, o in zip(cases, run.cases, strict=True))
    return ok / len(cases), run


def code_reward(
    sample: dict,
    time_s: float = 10.0,
    case_s: float = 2.0,
    memory_mb: int = 512,
    unsafe: bool = False,
) -> float:
    """Fraction of the sample's test cases the response's program passes, in a sandbox."""
    limits = Limits(time_s=time_s, case_s=case_s, memory_mb=memory_mb)
    score, run = run_tests(sample, limits, unsafe)
    hung = [k for k, case in enumerate(run.cases) if case.get("status") == "timeout"]
    if hung:
        raise SampleTimeout(
            f"test case {hung[0]} ran over its {case_s:g} s limit "
            f"({score:.0%} of the cases passed before it)"
        )
    return score
