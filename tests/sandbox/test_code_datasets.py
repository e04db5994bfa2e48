"""The code data sets' own test formats score a correct program 1.0 and a wrong one 0.0;
malformed test data is the sample's `error` naming the bad case, never a pass.

The cases are shaped as each data set ships them (field names, nesting, JSON-in-a-string,
lists of lines); each format is scored through `code_reward` in the real sandbox.
"""

from __future__ import annotations

import base64
import json
import pickle
import zlib

import pytest

from qreward_queue.rewards import sandbox
from qreward_queue.rewards.code import code_reward
from qreward_queue.rewards.testcases import BadTests, load_tests

DOUBLE = "n = int(input())\nprint(n * 2)\nprint('done')"  # two lines of output
WRONG = "n = int(input())\nprint(n * 3)\nprint('done')"
SQUARE = "def square(x):\n    return x * x"
LEET = "class Solution:\n    def square(self, x: int) -> int:\n        return x * x"

FORMATS = {
    # APPS / TACO `input_output` (a JSON string in the row), outputs as lists of lines
    "apps_lines": (
        DOUBLE,
        json.dumps({"inputs": ["3\n", "5\n"], "outputs": [["6", "done"], ["10", "done"]]}),
    ),
    "taco_text": (DOUBLE, json.dumps({"inputs": ["3\n"], "outputs": ["6\ndone\n"]})),
    # APPS / TACO call-based: each input is the argument list, each output wrapped in a list
    "taco_call": (
        SQUARE,
        json.dumps({"fn_name": "square", "inputs": [[3], [4]], "outputs": [[9], [16]]}),
    ),
    # verl prime_code / Eurus-2 ground truth: the same dict, given as the reference
    "verl_prime": (DOUBLE, json.dumps({"inputs": ["7\n"], "outputs": ["14\ndone\n"]})),
    # CodeContests: a row's test groups, each {"input": [...], "output": [...]}
    "code_contests": (
        DOUBLE,
        {
            "public_tests": {"input": ["1\n"], "output": ["2\ndone\n"]},
            "private_tests": {"input": ["2\n"], "output": ["4\ndone\n"]},
            "generated_tests": {"input": [], "output": []},
        },
    ),
    # LiveCodeBench code_generation_lite: JSON strings, `testtype`, metadata.func_name
    "livecodebench_stdin": (
        DOUBLE,
        {
            "public_test_cases": json.dumps(
                [{"input": "4\n", "output": "8\ndone\n", "testtype": "stdin"}]
            ),
            "metadata": "{}",
        },
    ),
    "livecodebench_private": (
        DOUBLE,
        {  # as shipped: base64 of zlib of a pickled string
            "private_test_cases": base64.b64encode(
                zlib.compress(
                    pickle.dumps(
                        json.dumps([{"input": "9\n", "output": "18\ndone\n", "testtype": "stdin"}])
                    )
                )
            ).decode(),
            "metadata": "{}",
        },
    ),
    "livecodebench_functional": (
        LEET,
        {
            "public_test_cases": json.dumps(
                [{"input": "5", "output": "25", "testtype": "functional"}]
            ),
            "metadata": json.dumps({"func_name": "square"}),
        },
    ),
    # open-r1 / PrimeIntellect verifiable-coding-problems `verification_info`
    "open_r1": (
        DOUBLE,
        {
            "verification_info": json.dumps(
                {
                    "language": "python",
                    "test_cases": [{"input": "6\n", "output": "12\ndone", "type": "stdin_stdout"}],
                }
            )
        },
    ),
    "prime_intellect_call": (
        SQUARE,
        json.dumps(
            {
                "language": "python",
                "test_cases": [
                    {"fn_name": "square", "input": [6], "output": [36], "type": "function_call"},
                ],
            }
        ),
    ),
}


@pytest.mark.parametrize("name", FORMATS)
def test_each_data_set_format_scores_a_correct_program_1_and_a_wrong_one_0(name):
    program, tests = FORMATS[name]
    sample = {"prompt": "", "response": program, "extra": {"tests": tests}}
    assert code_reward(sample) == 1.0, code_reward(sample).detail
    wrong = WRONG if "def " not in program else program.replace("x * x", "x + x")
    assert code_reward({**sample, "response": wrong}) == 0.0


MALFORMED = {
    "call without expected": [{"fn_name": "solve", "args": [3], "output": 9}],
    "fn_name not a string": [{"fn_name": 3, "args": [], "expected": 1}],
    "stdin without output": [{"input": "1\n"}],
    "a number as a case": [7],
    "input not text": [{"input": {"a": 1}, "output": "1"}],
    "functional case, not JSON": {
        "public_test_cases": [{"input": "x", "output": "1", "testtype": "functional"}],
        "metadata": {"func_name": "f"},
    },
    "a pickle naming a class": {
        "private_test_cases": base64.b64encode(zlib.compress(pickle.dumps(OSError("x")))).decode()
    },
    "another language": {"language": "cpp", "test_cases": [{"input": "", "output": ""}]},
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_test_data_is_an_error_naming_the_case_never_a_pass(name):
    # a program that would satisfy a lax reading of the case
    program = "globals()[None] = lambda *a: None\ndef solve(*a):\n    return None\ndef f(): pass"
    with pytest.raises(BadTests, match="code_reward"):
        code_reward({"prompt": "", "response": program, "extra": {"tests": MALFORMED[name]}})


def test_a_null_function_name_on_a_stdin_case_is_a_stdin_case():
    cases = load_tests({"extra": {"tests": [{"input": "2\n", "output": "4", "fn_name": None}]}})
    assert cases == [{"input": "2\n", "output": "4"}]
    hack = "globals()[None] = lambda *a: None\nprint(4)"
    assert code_reward({"prompt": "", "response": hack, "extra": {"tests": cases}}) == 1.0
    assert (
        code_reward(
            {
                "prompt": "",
                "response": "globals()[None] = lambda *a: None",
                "extra": {"tests": cases},
            }
        )
        == 0.0
    )


def test_the_deep_recursion_thread_idiom_passes_wherever_the_sandbox_runs():
    program = (
        "import sys, threading\nsys.setrecursionlimit(1 << 20)\nthreading.stack_size(1 << 26)\n"
        "def depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\n"
        "def main():\n    print(depth(int(input())))\n"
        "threading.Thread(target=main).start()"
    )
    sample = {
        "prompt": "",
        "response": program,
        "extra": {"tests": [{"input": "50000", "output": "50000"}]},
    }
    scored = code_reward(sample)
    assert scored == 1.0, (sandbox.describe(), scored.detail)
