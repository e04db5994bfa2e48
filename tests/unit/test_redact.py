"""Unit tests of qreward_queue/redact.py: what counts as a secret, and the log filter."""

from __future__ import annotations

import io
import logging

import pytest

from qreward_queue import redact as r
from qreward_queue.errors import PermanentError
from qreward_queue.samples import Outcome

KEY = "qrq-unit-Hx7Lp2Qw9Zr4Tn8Vb3Mk"


@pytest.fixture(autouse=True)
def remembered(monkeypatch):
    monkeypatch.setattr(r, "_secrets", ())
    monkeypatch.setattr(r, "_any_piece", None)
    r.remember(KEY)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"bad key {KEY}!", "bad key [REDACTED]!"),
        (f"Incorrect API key provided: {KEY[:10]}****{KEY[-4:]}", "Incorrect API key provided: "
         "[REDACTED]****" + KEY[-4:]),
        (f"{KEY}{KEY}", "[REDACTED]"),
        ("Authorization: Bearer abc.DEF-123==", "Authorization: Bearer [REDACTED]"),
        ("key sk-proj-abcdefghijklmnopqrstu end", "key [REDACTED] end"),
        ("Score: 0.5 (unit tests)", "Score: 0.5 (unit tests)"),
        (None, None),
        ("", ""),
    ],
)
def test_redact(text, expected):
    assert r.redact(text) == expected


def test_short_or_empty_secrets_are_not_remembered():
    r.remember("")
    r.remember(None)
    r.remember("abc")
    assert r._secrets == (KEY,)


def test_errors_and_outcomes_are_redacted_where_they_are_built():
    error = PermanentError(f"rejected: {KEY}", f"detail {KEY}")
    assert KEY not in str(error) and KEY not in error.detail
    outcome = Outcome(0.0, "error", error=f"e {KEY}", detail=f"d {KEY}")
    assert (outcome.error, outcome.detail) == ("e [REDACTED]", "d [REDACTED]")
    assert Outcome.from_dict({"score": 1.0, "detail": KEY}).detail == "[REDACTED]"


def test_log_filter_redacts_messages_and_tracebacks():
    stream = io.StringIO()
    logger = logging.getLogger("qrq-redact-test")
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    r.install_log_filter(logger)
    r.install_log_filter(logger)  # idempotent
    try:
        logger.warning("reply: %s", KEY)
        try:
            raise ValueError(f"boom {KEY}")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    assert KEY not in stream.getvalue() and stream.getvalue().count("[REDACTED]") == 2
    assert len(handler.filters) == 1
