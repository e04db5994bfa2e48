"""Code execution: run the response's program against test cases in a sandbox; the score is
the fraction of cases passed.

Test cases come from `sample["extra"]["tests"]`, else from `sample["reference"]` as JSON, in
the shapes the usual data sets ship (APPS, TACO, CodeContests, LiveCodeBench, open-r1's and
PrimeIntellect's `verification_info`: the table is in `testcases.py`); malformed test data is
the sample's `error` naming the bad case.
The program is the last ```python fenced block of the response (else the whole response).
All cases of one sample run in ONE sandbox (`sandbox.run_cases`: one process, a fork per
case), which is what makes thousands of samples per minute possible. Expected outputs stay
outside the sandbox; stdout is compared line by line with trailing whitespace ignored,
integer tokens exactly and decimal ones within `float_tol` (default 1e-6, absolute or
relative above 1; a backend file sets it in `[backend.options]`). The program's own
failures (wrong output, a crash, a hang past `case_s`, a limit) fail those cases: the sample
is scored, with the reasons in the outcome's `detail`. A hang skips the remaining cases.

Example:
    >>> code_reward({"prompt": "", "response": "print(int(input()) * 2)",
    ...              "extra": {"tests": [{"input": "2", "output": "4"}]}})
    1.0
"""

from __future__ import annotations

import json
import re
from typing import Any

from . import Scored, sandbox
from .sandbox import GRACE_S, Limits, Run, bound_s, case_wall_s, run_cases
from .testcases import load_tests

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(response: str) -> str:
    """The last fenced Python block of a response, else the response itself."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


_INT = re.compile(r"[+-]?[0-9]+")
# unambiguous (each character has one way to match), so a failed match is linear in its length
_FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
MAX_DECIMAL = 100  # characters; a longer token is compared as text
FLOAT_TOL = 1e-6
START_S = 1.0  # the sandbox's start and the comparison, beyond its own time bound
MAX_DEPTH = 100  # nesting of a call's expected value compared; deeper is a failed case


def _integer(token: str) -> str:
    digits = token.lstrip("+-").lstrip("0") or "0"
    return ("-" if token.startswith("-") and digits != "0" else "") + digits


def _close(got: float, want: float, tol: float) -> bool:
    return abs(got - want) <= tol * max(1.0, abs(want))


def _same_token(got: str, want: str, tol: float) -> bool:
    """Integers exactly (any length); a decimal expected value within `tol`; else equal text."""
    if got == want:
        return True
    if _INT.fullmatch(want):
        return _INT.fullmatch(got) is not None and _integer(got) == _integer(want)
    if max(len(got), len(want)) > MAX_DECIMAL:
        return False
    if _FLOAT.fullmatch(want) and _FLOAT.fullmatch(got):
        return _close(float(got), float(want), tol)
    return False


def same_output(got: str, want: str, float_tol: float = FLOAT_TOL) -> bool:
    """Equal line by line, trailing whitespace and blank lines ignored; integer tokens
    exactly, decimal ones within `float_tol` (absolute, or relative above 1)."""
    lines = [line.rstrip() for line in got.strip().splitlines()]
    expected = [line.rstrip() for line in str(want).strip().splitlines()]
    if lines == expected:
        return True
    tokens, wanted = " ".join(lines).split(), " ".join(expected).split()
    return len(tokens) == len(wanted) and all(
        _same_token(a, b, float_tol) for a, b in zip(tokens, wanted, strict=True)
    )


def same_value(got: Any, want: Any, float_tol: float = FLOAT_TOL, depth: int = 0) -> bool:
    """JSON values equal: types must match (a bool is not 1), integers exactly, a float
    expected within `float_tol`, lists and objects element by element."""
    if depth > MAX_DEPTH:
        return False
    if isinstance(want, bool) or isinstance(got, bool) or want is None or isinstance(want, str):
        return type(got) is type(want) and got == want
    if isinstance(want, int):
        return type(got) is int and got == want
    if isinstance(want, float):
        return isinstance(got, (int, float)) and _close(float(got), want, float_tol)
    if isinstance(want, list):
        return (
            isinstance(got, list)
            and len(got) == len(want)
            and all(same_value(g, w, float_tol, depth + 1) for g, w in zip(got, want, strict=True))
        )
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and got.keys() == want.keys()
            and all(same_value(got[k], want[k], float_tol, depth + 1) for k in want)
        )
    return False


def verdict(case: dict, outcome: dict, float_tol: float = FLOAT_TOL) -> str | None:
    """None when the program passed this case, else why not. Never raises: whatever the
    program printed or returned, a comparison that fails is a failed case."""
    if outcome.get("status") != "ok":
        return outcome.get("error") or outcome.get("status", "no outcome")
    try:
        if "fn_name" not in case:
            ok = same_output(outcome.get("stdout", ""), case["output"], float_tol)
            return None if ok else "wrong output"
        try:
            value = json.loads(outcome.get("result", ""))
        except ValueError:
            return "no JSON value returned"
        want = case["expected"]
        # TACO wraps a call's expected value in a one-element list
        ok = same_value(value, want, float_tol) or (
            isinstance(want, list) and len(want) == 1 and same_value(value, want[0], float_tol)
        )
        return None if ok else "wrong value returned"
    except Exception as exc:  # e.g. RecursionError on a deeply nested value
        return f"cannot compare the output ({type(exc).__name__})"


def passed(case: dict, outcome: dict, float_tol: float = FLOAT_TOL) -> bool:
    """Did the program pass this case?"""
    return verdict(case, outcome, float_tol) is None


def run_tests(
    sample: dict,
    limits: Limits = Limits(),  # noqa: B008
    unsafe: bool = False,
    float_tol: float = FLOAT_TOL,
) -> tuple[float, Run, list[str | None]]:
    """(fraction passed, the sandbox run with every case's outcome, why each case failed)."""
    cases = load_tests(sample)
    inputs = [
        {"fn_name": c["fn_name"], "args": c["args"]} if "fn_name" in c else {"input": c["input"]}
        for c in cases
    ]
    run = run_cases(extract_code(sample["response"]), inputs, limits, unsafe=unsafe)
    why = [verdict(c, o, float_tol) for c, o in zip(cases, run.cases, strict=True)]
    return sum(w is None for w in why) / len(cases), run, why


def code_reward(
    sample: dict,
    time_s: float = 10.0,
    case_s: float = 2.0,
    memory_mb: int = 512,
    unsafe: bool = False,
    float_tol: float = FLOAT_TOL,
    loopback: bool = False,
) -> Scored:
    """Fraction of the sample's test cases the response's program passes, in a sandbox; the
    failed cases and why in `.detail`. A program that hangs, crashes or overruns a limit
    fails those cases; only the sandbox's own failure raises (SandboxError: `error`)."""
    limits = Limits(time_s=time_s, case_s=case_s, memory_mb=memory_mb, loopback=loopback)
    score, _, why = run_tests(sample, limits, unsafe, float_tol)
    failed = [f"case {k}: {w}" for k, w in enumerate(why) if w is not None]
    detail = f"{len(why) - len(failed)}/{len(why)} cases passed"
    return Scored(score, "; ".join([detail, *failed])[:1000])


def time_needed_s(time_s: float = 10.0, case_s: float = 2.0, **_: Any) -> tuple[float, str]:
    """The longest one sample can take with these options, and why: a function backend's
    `timeout_s` below it would kill samples the sandbox is still scoring (checked when the
    backend file loads)."""
    bound = bound_s(Limits(time_s=float(time_s), case_s=float(case_s))) + START_S
    why = f"code_reward's time_s {time_s:g} + a last case's wall clock"
    why += f" {case_wall_s(float(case_s)):g} + the sandbox's {GRACE_S:g} s grace"
    return bound, f"{why} + {START_S:g} s to start it"


def preflight(unsafe: bool = False, **_: Any) -> list[str]:
    """Which sandbox runs the programs here, in one line, checked before a worker starts
    (raises SandboxUnavailable when none can)."""
    return [sandbox.describe(unsafe=bool(unsafe))]


code_reward.time_needed_s = time_needed_s  # type: ignore[attr-defined]
code_reward.preflight = preflight  # type: ignore[attr-defined]
