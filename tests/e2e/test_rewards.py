"""The built-in rewards on real-looking examples (GSM8K, MATH, R1-style format), called directly
and through the function backend (helper process, options from the backend file)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from qreward_queue.backends import FunctionOptions, make_backend
from qreward_queue.backends.function_runner import load_function
from qreward_queue.config.loader import load_backend
from qreward_queue.config.model import Backend
from qreward_queue.errors import PermanentError
from qreward_queue.rewards import sandbox
from qreward_queue.rewards.combine import weighted_sum
from qreward_queue.rewards.format import format_reward, has_structure, repetition
from qreward_queue.rewards.math import extract_answer, fast_equal, math_reward

ROOT = Path(__file__).resolve().parents[2]
GSM8K_REFERENCE = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


def s(response: str, reference: str | None = None) -> dict:
    return {"prompt": "q", "response": response, "reference": reference}


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so the total is \\boxed{\\frac{3}{4}} and done", "\\frac{3}{4}"),
        ("nested \\boxed{\\sqrt{\\frac{1}{2}}}", "\\sqrt{\\frac{1}{2}}"),
        ("first \\boxed{1} then \\fbox{2}", "2"),
        (GSM8K_REFERENCE, "72"),
        ("Thus, the answer is 1,200.", "1,200"),
        ("We get 3 apples, then 5 more, 8 in all", "8"),
        ("no answer here", None),
        ("cut off \\boxed{12", "12"),  # an unclosed box falls through to the last number
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    ("predicted", "gold"),
    [
        ("1,000", "1000"),
        ("0.75", "3/4"),
        ("\\frac{3}{4}", "0.75"),
        ("75\\%", "0.75"),
        ("$12$", "12"),
        ("\\text{12}", "12.0"),
    ],
)
def test_fast_path_numbers_and_strings(predicted, gold):
    assert fast_equal(predicted, gold)


def test_math_reward_on_gsm8k_and_math_style_answers():
    assert math_reward(s("Natalia sold 24 in May, so 72 in all.\n#### 72", GSM8K_REFERENCE)) == 1.0
    assert math_reward(s("She sold 48 + 48/2 = 70.\n#### 70", GSM8K_REFERENCE)) == 0.0
    assert math_reward(s("So $x = \\boxed{\\dfrac{1}{2}}$.", "\\frac{1}{2}")) == 1.0
    assert math_reward(s("The answer is \\boxed{0.5}", "$\\frac12$")) == 1.0
    assert math_reward(s("I think \\boxed{3}", "4")) == 0.0


def test_math_verify_decides_what_the_fast_path_cannot():
    pytest.importorskip("math_verify")
    assert math_reward(s("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}")) == 1.0
    assert math_reward(s("\\boxed{(x+1)^2}", "x^2+2x+1")) == 1.0
    assert math_reward(s("\\boxed{x^2+1}", "x^2+2x+1")) == 0.0
    assert math_reward(s("\\boxed{[1, 3)}", "[1,3)")) == 1.0
    # without math-verify the fast path alone says no
    assert math_reward(s("\\boxed{(x+1)^2}", "x^2+2x+1"), use_math_verify=False) == 0.0


def test_math_verify_in_a_thread_runs_without_its_signal_timeouts():
    pytest.importorskip("math_verify")
    scores = []
    thread = threading.Thread(
        target=lambda: scores.append(math_reward(s("\\boxed{(x+1)^2}", "x^2+2x+1")))
    )
    thread.start()
    thread.join(60)
    assert scores == [1.0]


@pytest.mark.parametrize(
    ("reference", "reason"),
    [
        ("", "'reference' is empty"),
        ("Some working.\n#### ", "no answer in reference"),
        (None, "needs the sample's 'reference'"),
    ],
)
def test_unreadable_reference_is_an_error_not_a_zero(reference, reason):
    with pytest.raises(ValueError, match=reason):
        math_reward(s("\\boxed{1}", reference))


R1 = "<think>\n48/2 = 24, 48 + 24 = 72\n</think>\n<answer>72</answer>"


@pytest.mark.parametrize(
    ("response", "ok"),
    [
        (R1, True),
        ("  <think>x</think><answer>y</answer>\n", True),
        ("<answer>72</answer>", False),  # no thinking
        ("<think>a</think>extra text<answer>72</answer>", False),  # text between the tags
        ("<think>a</think><think>b</think><answer>72</answer>", False),  # repeated
        ("<answer>72</answer><think>a</think>", False),  # out of order
        ("<think>a<answer>1</answer></think><answer>72</answer>", False),  # nested
        ("<think>a</think><answer>72", False),  # unclosed
    ],
)
def test_format_structure(response, ok):
    assert format_reward(s(response)) == (1.0 if ok else 0.0)


def test_format_configurable_tags_and_penalties():
    assert has_structure("<reasoning>r</reasoning> <code>c</code>", ("reasoning", "code"))
    assert format_reward(s("<answer>1</answer>"), tags=["answer"], score=0.5) == 0.5
    long = "<think>" + "word " * 400 + "</think><answer>1</answer>"
    # overlong: linear from soft_chars (1000) to max_chars (3000)
    assert format_reward(s(long), soft_chars=1000, max_chars=3000) == pytest.approx(
        1.0 - (len(long) - 1000) / 2000
    )
    assert format_reward(s(long), max_chars=100) == 0.0  # fully over: -1 on top of 1
    assert repetition("a b c d e f g h") == 0.0
    assert repetition("go " * 50) > 0.9
    assert format_reward(s(long), repetition_penalty=0.5) == pytest.approx(
        1.0 - 0.5 * repetition(long)
    )
    with pytest.raises(ValueError, match="tags must be non-empty tag names"):
        format_reward(s(R1), tags=["<bad>"])


def test_weighted_sum_of_format_and_math():
    parts = [
        {"function": "qreward_queue.rewards.format:format_reward", "weight": 0.2},
        {"function": "qreward_queue.rewards.math:math_reward", "weight": 1.0},
    ]
    assert weighted_sum(s(R1, GSM8K_REFERENCE), parts) == pytest.approx(1.2)
    assert weighted_sum(s("72", GSM8K_REFERENCE), parts) == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"math_reward failed: ValueError: .*'reference'"):
        weighted_sum(s(R1), parts)


def test_rewards_through_the_function_backend_with_options():
    parts = [
        {
            "function": "qreward_queue.rewards.format:format_reward",
            "weight": 0.5,
            "options": {"tags": ["answer"]},
        },
        {"function": "qreward_queue.rewards.math:math_reward", "weight": 1.0},
    ]
    combined = Backend(name="fm", kind="function", chunk_size=8, timeout_s=30,
                       options=FunctionOptions(function="qreward_queue.rewards.combine:weighted_sum",
                                               options={"parts": parts}))
    scores = (
        make_backend(combined)
        .call(
            [
                s("<answer>\\boxed{72}</answer>", GSM8K_REFERENCE),
                s("<answer>\\boxed{70}</answer>", GSM8K_REFERENCE),
                s("72", ""),
            ]
        )
        .scores
    )
    assert scores[:2] == [1.5, 0.5]
    assert isinstance(scores[2], PermanentError) and "'reference' is empty" in str(scores[2])


def test_a_code_reward_backend_names_its_sandbox_before_a_worker_starts():
    code = {"function": "qreward_queue.rewards.code:code_reward", "options": {"unsafe": True}}
    parts = [code, code, {"function": "qreward_queue.rewards.format:format_reward"}]
    combined = Backend("c", "function", options=FunctionOptions(
        function="qreward_queue.rewards.combine:weighted_sum", options={"parts": parts}))
    # the sandbox in force here, probed (bwrap, else unshare, else none as unsafe allows)
    line = sandbox.describe(unsafe=True)
    assert line.startswith("code sandbox: ")
    assert make_backend(combined).preflight() == [line]  # once, for the parts that need it
    plain = Backend("f", "function", options=FunctionOptions(
        function="qreward_queue.rewards.format:format_reward"))
    assert make_backend(plain).preflight() == []


@pytest.mark.parametrize("name", ["math", "format", "code", "format-math"])
def test_example_backend_files_load(name):
    backend = load_backend(ROOT / "examples" / "workers" / f"{name}.toml")
    assert backend.name == name and backend.kind == "function"
    assert load_function(backend.options.function)
    for part in backend.options.options.get("parts", []):
        assert load_function(part["function"])


def test_math_verify_through_embedded_mode(tmp_path):
    # Given embedded mode (worker threads) and a math backend; math-verify's timeouts use
    # SIGALRM: the function runs in the main thread of a helper process, where they work
    pytest.importorskip("math_verify")
    from support import write_config

    import qreward_queue

    tables = {
        "backend": {
            "kind": "function",
            "function": "qreward_queue.rewards.math:math_reward",
            "chunk_size": 4,
            "timeout_s": 30,
        },
        "pool": {"type": "threads", "concurrency": 2},
    }
    config = write_config(tmp_path, {"math": tables}, routes={})
    qreward_queue.configure(qreward_queue.load_config(config))
    samples = [
        s("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}"),
        s("\\boxed{(x+1)^2}", "x^2+2x+1"),
        s("\\boxed{x^2+1}", "x^2+2x+1"),
        s("#### 72", GSM8K_REFERENCE),
    ]
    outcomes = qreward_queue.submit_batch(samples, route="math").outcomes(timeout=120)
    assert [(o.status, o.score) for o in outcomes] == [
        ("ok", 1.0),
        ("ok", 1.0),
        ("ok", 0.0),
        ("ok", 1.0),
    ], outcomes
