"""Built-in CPU rewards, each `fn(sample, **options) -> float`, usable as `function` backends.

- `math.math_reward`: final-answer extraction, a fast string/number path, then math-verify;
- `format.format_reward`: tag structure, overlong and repetition penalties;
- `code.code_reward`: the response's program against test cases, in `sandbox`;
- `combine.weighted_sum`: several rewards of one sample in one task;
- `basic.exact_match`: the last number against the reference's.
"""

from __future__ import annotations


class Scored(float):
    """A score that carries a short explanation (`detail`, e.g. which test cases failed);
    a `function` backend puts it in the outcome's `detail`. Compares and adds as its float."""

    detail: str

    def __new__(cls, value: float, detail: str = "") -> Scored:  # the default: for pickle
        scored = super().__new__(cls, value)
        scored.detail = detail
        return scored
