"""A sample's test cases, in the shapes the code data sets ship, checked and made uniform.

Every accepted shape becomes a list of cases of two kinds:
- stdin: `{"input": str, "output": str}` (the program's stdout is compared with `output`);
- call: `{"fn_name": str, "args": list, "expected": value}` (a top-level function, or a
  method of LeetCode's `class Solution`, called with `args`; its return value compared).

Accepted (a JSON string of any of these is read too; the table in docs/cpu-rewards.md shows each):
- qrq: a list of cases in the two shapes above;
- APPS, TACO, verl's prime_code (Eurus-2 / PRIME), code-r1: `{"inputs": [...], "outputs":
  [...], "fn_name"?}`; a stdin input or output may be a list of lines, a call's output
  `[value]`;
- CodeContests: `{"input": [...], "output": [...]}`, or a row's `public_tests`,
  `private_tests` and `generated_tests` (all used);
- LiveCodeBench: a row's `public_test_cases` / `private_test_cases` (JSON text; the
  private ones as shipped, base64 of zlib of a pickled string, are read by an unpickler that
  builds no object but plain data), cases `{"input", "output", "testtype": "stdin" or
  "functional"}`, the function in `metadata.func_name`; a functional input is one JSON
  argument per line, its output JSON;
- open-r1 and PrimeIntellect's verifiable-coding-problems: `verification_info`,
  `{"language"?, "test_cases": [...]}` with cases `{"type": "stdin_stdout", "input",
  "output"}` or `{"type": "function_call", "fn_name", "input": args, "output"}`.

A case that fits none of them (a call without `expected`, a function name that is not a
string, an input that is not text) is a ValueError naming the case: malformed data is the
sample's `error`, never a score.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import zlib
from typing import Any

CODE_CONTESTS = ("public_tests", "private_tests", "generated_tests")
LIVECODEBENCH = ("public_test_cases", "private_test_cases")


class BadTests(ValueError):
    """The sample's test data is malformed (the data's fault): the sample is an `error`."""


def load_tests(sample: dict) -> list[dict]:
    """The sample's test cases (`extra["tests"]`, else `reference` as JSON), uniform."""
    raw: Any = (sample.get("extra") or {}).get("tests")
    if raw is None:
        raw = sample.get("reference")
        if raw is None:
            raise BadTests("code_reward needs test cases in extra['tests'] or 'reference'")
    raw = _json(raw, "'reference'" if isinstance(raw, str) else "the test cases")
    cases = _cases(raw)
    if not cases:
        raise BadTests("code_reward: no test cases")
    return [_checked(k, case) for k, case in enumerate(cases)]


def _json(value: Any, what: str) -> Any:
    """A JSON document given as text is read; anything else is taken as it is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as exc:
        raise BadTests(f"code_reward: {what} is not JSON test cases ({exc})") from None


def _cases(raw: Any) -> list:
    """The raw cases of any accepted container, before each is checked."""
    if isinstance(raw, list):
        return raw
    if not isinstance(raw, dict):
        raise BadTests(f"code_reward: test cases must be a list or an object, not {_kind(raw)}")
    if "verification_info" in raw:  # a whole open-r1 / PrimeIntellect row
        return _cases(_json(raw["verification_info"], "'verification_info'"))
    if "test_cases" in raw:
        language = str(raw.get("language") or "python").lower()
        if language not in ("python", "python3"):
            raise BadTests(f"code_reward runs Python; these test cases are for {language!r}")
        return _listed(_json(raw["test_cases"], "'test_cases'"), "test_cases")
    if any(key in raw for key in LIVECODEBENCH):
        return _livecodebench(raw)
    if any(key in raw for key in CODE_CONTESTS):
        return [c for key in CODE_CONTESTS if key in raw for c in _io_lists(raw[key], key)]
    if "inputs" in raw or "outputs" in raw:  # APPS / TACO input_output
        name = raw.get("fn_name")
        pairs = _pairs(raw, "inputs", "outputs")
        if name is None:
            return [{"input": i, "output": o} for i, o in pairs]
        return [{"fn_name": name, "args": i, "expected": o} for i, o in pairs]
    if "input" in raw and isinstance(raw["input"], list):  # one CodeContests group
        return _io_lists(raw, "tests")
    raise BadTests(f"code_reward: unknown test case format (keys {sorted(raw)[:8]})")


def _listed(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise BadTests(f"code_reward: {what!r} must be a list of cases, not {_kind(value)}")
    return value


def _pairs(raw: dict, inputs: str, outputs: str) -> list[tuple[Any, Any]]:
    ins, outs = raw.get(inputs), raw.get(outputs)
    if not isinstance(ins, list) or not isinstance(outs, list):
        raise BadTests(f"code_reward: test cases need lists {inputs!r} and {outputs!r}")
    if len(ins) != len(outs):
        raise BadTests(f"code_reward: {len(ins)} {inputs} but {len(outs)} {outputs}")
    return list(zip(ins, outs, strict=True))


def _io_lists(group: Any, what: str) -> list[dict]:
    """A CodeContests group: `{"input": [...], "output": [...]}`."""
    if not isinstance(group, dict):
        raise BadTests(f"code_reward: {what!r} must be an object of lists, not {_kind(group)}")
    return [{"input": i, "output": o} for i, o in _pairs(group, "input", "output")]


def _livecodebench(row: dict) -> list:
    metadata = _json(row.get("metadata") or {}, "'metadata'")
    name = metadata.get("func_name") if isinstance(metadata, dict) else None
    cases = []
    for key in LIVECODEBENCH:
        if key in row:
            for case in _listed(_json(_unpacked(row[key]), repr(key)), key):
                if isinstance(case, dict) and case.get("testtype") == "functional":
                    case = {"fn_name": name, **case}
                cases.append(case)
    return cases


class _PlainData(pickle.Unpickler):
    """Unpickles strings, numbers, lists and dicts; refuses every class or function."""

    def find_class(self, module: str, name: str) -> Any:
        raise BadTests(f"code_reward: packed test cases name {module}.{name}: refused")


def _unpacked(value: Any) -> Any:
    """LiveCodeBench's private cases: base64 of zlib of a pickled JSON string."""
    if not isinstance(value, str) or value.lstrip()[:1] in ("[", "{", ""):
        return value
    try:
        packed = zlib.decompress(base64.b64decode(value, validate=True))
        return _PlainData(io.BytesIO(packed)).load()
    except (ValueError, zlib.error, pickle.UnpicklingError, EOFError) as exc:
        raise BadTests(f"code_reward: packed test cases cannot be read ({exc})") from None


def _checked(k: int, case: Any) -> dict:
    """One case in its uniform shape; BadTests naming case `k` when it is malformed."""

    def bad(why: str) -> BadTests:
        return BadTests(f"code_reward: test case {k} {why}")

    if not isinstance(case, dict):
        raise bad(f"is {_kind(case)}, not an object")
    name = case.get("fn_name")
    call = case.get("type") == "function_call" or case.get("testtype") == "functional"
    if name in (None, "") and not call:  # a null or empty name: a stdin case
        if "input" not in case or "output" not in case:
            raise bad("needs 'input' and 'output' (stdin/stdout) or 'fn_name' (a call)")
        return {
            "input": _text(case["input"], bad, "input"),
            "output": _text(case["output"], bad, "output"),
        }
    if not isinstance(name, str) or not name.isidentifier():
        raise bad(f"names no function: 'fn_name' is {name!r}")
    if case.get("testtype") == "functional":  # LiveCodeBench: JSON lines in, JSON out
        lines = _text(case.get("input", ""), bad, "input").splitlines()
        try:
            args = [json.loads(line) for line in lines if line.strip()]
            expected = json.loads(_text(case.get("output"), bad, "output"))
        except ValueError as exc:
            raise bad(f"is not JSON as a functional case must be ({exc})") from None
        return {"fn_name": name, "args": args, "expected": expected}
    args_key, expected_key = ("input", "output") if "args" not in case else ("args", "expected")
    if expected_key not in case:
        raise bad(f"is a call of {name!r} without {expected_key!r}: nothing to compare")
    args = case.get(args_key, [])
    return {
        "fn_name": name,
        "args": args if isinstance(args, list) else [args],
        "expected": case[expected_key],
    }


def _text(value: Any, bad: Any, what: str) -> str:
    """A stdin case's input or output: text, or a list of lines (APPS, TACO)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):  # a bare number
        return str(value)
    raise bad(f"has {_kind(value)} as its {what}: text or a list of lines is expected")


def _kind(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__}"
