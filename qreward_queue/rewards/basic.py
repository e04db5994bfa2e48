"""Cheap verifiable rewards: exact match on the last number of the response."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text.replace(",", ""))
    return found[-1] if found else None


def exact_match(sample: dict) -> float:
    """1.0 when the last number in the response equals the reference's last number."""
    reference = sample.get("reference")
    if reference is None:
        raise ValueError("exact_match needs the sample's 'reference'")
    got, want = last_number(sample["response"]), last_number(reference)
    if want is None:
        raise ValueError(f"reference {reference!r} holds no number")
    return 1.0 if got is not None and float(got) == float(want) else 0.0
