"""Scrub secrets out of any text qrq stores, logs or returns.

Why: a backend's reply is untrusted text, and some quote the API key they were sent (OpenAI's
401 quotes part of it; a proxy's 500 may echo the whole request). Reply text lands in outcome
`error`/`detail`, in Redis result keys, in worker logs and in Flower, so every one of them goes
through `redact()` first.

Removed: every configured API key that qrq has read (`remember()` is called where a key is
read from the environment), any run of `MIN_QUOTE` or more characters of such a key (a partial
quote), `Bearer <token>` and `sk-...`-style keys, whatever their origin.
"""

from __future__ import annotations

import logging
import re
import threading
from urllib.parse import urlsplit, urlunsplit

MASK = "[REDACTED]"
MIN_QUOTE = 8  # a quoted run of a key this long is a leak; shorter runs are noise
_PIECE = MIN_QUOTE // 2  # any run of MIN_QUOTE holds one whole key piece at a multiple of this
_PATTERNS = re.compile(
    r"(?i)\b(bearer)\s+[A-Za-z0-9\-._~+/]+=*"  # an Authorization header value
    r"|\bsk-[A-Za-z0-9_\-]{16,}"  # OpenAI-style secret keys
)
_lock = threading.Lock()
_secrets: tuple[str, ...] = ()
_any_piece: re.Pattern[str] | None = None  # a quick test: could `text` quote any secret?


def remember(secret: str | None) -> None:
    """Redact `secret` (and any run of MIN_QUOTE characters of it) from now on, here."""
    global _secrets, _any_piece
    if not secret or len(secret) < MIN_QUOTE or secret in _secrets:
        return
    with _lock:
        _secrets = (*_secrets, secret)
        pieces = {
            s[m : m + _PIECE] for s in _secrets for m in range(0, len(s) - _PIECE + 1, _PIECE)
        }
        _any_piece = re.compile("|".join(map(re.escape, sorted(pieces))))


def redact(text: str | None) -> str | None:
    """`text` with every secret replaced by MASK (None and non-text pass through)."""
    if not text or not isinstance(text, str):
        return text
    lowered = text.lower()
    if "bearer" in lowered or "sk-" in lowered:  # the regex costs more than these two scans
        text = _PATTERNS.sub(lambda m: f"{m.group(1)} {MASK}" if m.group(1) else MASK, text)
    if _any_piece is None or not _any_piece.search(text):
        return text
    spans = sorted(span for secret in _secrets for span in _quoted_runs(text, secret))
    if not spans:
        return text
    out, last = [], 0
    for start, end in spans:
        if end <= last:
            continue
        out += [text[last:max(start, last)], MASK] if start >= last else [MASK]
        last = end
    return "".join([*out, text[last:]]).replace(MASK + MASK, MASK)


def _quoted_runs(text: str, secret: str):
    """(start, end) of each run of at least MIN_QUOTE characters of `secret` inside `text`.

    Each such run contains a whole piece secret[m:m+_PIECE] with m a multiple of _PIECE, so a
    few C-speed `find`s locate the candidates, and each is grown to its full length.
    """
    for m in range(0, len(secret) - _PIECE + 1, _PIECE):
        at = text.find(secret[m : m + _PIECE])
        while at != -1:
            a, b, i, j = at, at + _PIECE, m, m + _PIECE
            while a > 0 and i > 0 and text[a - 1] == secret[i - 1]:
                a, i = a - 1, i - 1
            while b < len(text) and j < len(secret) and text[b] == secret[j]:
                b, j = b + 1, j + 1
            if b - a >= MIN_QUOTE:
                yield a, b
            at = text.find(secret[m : m + _PIECE], at + 1)


class RedactingFilter(logging.Filter):
    """A logging filter that redacts the formatted message (and a traceback's text)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


def install_log_filter(logger: logging.Logger | None = None) -> None:
    """Redact every record that reaches the handlers of `logger` (default: the root logger)."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


def redact_url(url: str) -> str:
    """`url` without user name or password, safe for messages and logs."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))
