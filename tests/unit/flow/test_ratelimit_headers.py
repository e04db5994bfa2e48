"""Every value learned from a backend's headers is validated and bounded (issue 12, item 4)."""

from __future__ import annotations

import pytest

from qreward_queue.config.loader import load_backend
from qreward_queue.flow.ratelimit_headers import MAX_RESET_S, Feedback, RateLimitHeaders


def read(max_pause_s: float = 60.0, **headers: str) -> RateLimitHeaders:
    return RateLimitHeaders.from_headers(
        {k.replace("_", "-"): v for k, v in headers.items()}, max_pause_s=max_pause_s
    )


def test_a_huge_retry_after_is_capped_at_max_pause_and_says_so():
    h = read(retry_after="999999")
    assert h.retry_after_s == 60.0 and h.pause_s() == 60.0
    assert h.bounded == ("retry-after 999999 capped at 60 s",)
    assert read(max_pause_s=5, retry_after_ms="999999").retry_after_s == 5.0


@pytest.mark.parametrize("value", ["-1", "soon", "nan", "inf", "1e400"])
def test_negative_or_garbage_retry_after_is_ignored_with_a_note(value):
    h = read(retry_after=value)
    assert h.retry_after_s is None
    assert len(h.bounded) == 1 and h.bounded[0].startswith("retry-after"), h.bounded
    assert h.pause_s() == 0.0  # no pause of everyone: each call backs off on its own


@pytest.mark.parametrize("value", ["0", "0.5", "-3"])
def test_a_learned_limit_below_the_floor_is_ignored(value):
    h = read(x_ratelimit_limit_requests=value, x_ratelimit_limit_tokens=value)
    assert (h.limit_requests, h.limit_tokens) == (None, None)
    assert len(h.bounded) == 2, h.bounded


def test_a_far_reset_is_capped_and_the_pause_it_orders_is_bounded():
    h = read(x_ratelimit_reset_requests="1e308", x_ratelimit_remaining_requests="0")
    assert h.reset_requests_s == MAX_RESET_S
    assert "x-ratelimit-reset-requests 1e308 capped at 86400 s" in h.bounded
    assert h.pause_s() == 60.0


def test_huge_counts_are_ignored_and_sane_values_pass_untouched():
    h = read(x_ratelimit_remaining_tokens="9" * 400, x_ratelimit_remaining_requests="9" * 20,
             x_ratelimit_limit_tokens="90000", x_ratelimit_reset_tokens="6m0s", retry_after="2")
    assert (h.remaining_tokens, h.remaining_requests, h.limit_tokens, h.reset_tokens_s,
            h.retry_after_s) == (None, None, 90000.0, 360.0, 2.0)
    assert h.bounded == (f"x-ratelimit-remaining-requests {'9' * 20} ignored: above 1e+12",
                         f"x-ratelimit-remaining-tokens {'9' * 40!r} ignored: not a count")
    assert read(retry_after="2").bounded == ()


def test_max_pause_s_is_configured_per_backend(tmp_path):
    path = tmp_path / "j.toml"
    path.write_text('[backend]\nkind = "judge"\nurl = "http://h/v1"\nmodel = "m"\n')
    assert load_backend(path).limits.max_pause_s == 60.0
    path.write_text(path.read_text() + "[limits]\nmax_pause_s = 15\n")
    assert load_backend(path).limits.max_pause_s == 15.0


def test_anthropic_headers_fill_the_same_fields_and_name_themselves_when_wrong():
    told = RateLimitHeaders.from_headers({
        "anthropic-ratelimit-requests-limit": "50",
        "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": "1970-01-01T00:01:40Z",
        "anthropic-ratelimit-tokens-limit": "40000",
        "anthropic-ratelimit-tokens-remaining": "39000",
        "anthropic-ratelimit-tokens-reset": "soon",
        "retry-after": "3",
    }, now=95.0)
    assert (told.limit_requests, told.remaining_requests, told.reset_requests_s) == (50, 0, 5)
    assert (told.limit_tokens, told.remaining_tokens, told.reset_tokens_s) == (40000, 39000, None)
    assert told.retry_after_s == 3 and told.pause_s() == 3
    assert told.bounded == ("anthropic-ratelimit-tokens-reset 'soon' ignored: not a delay",)
    # OpenAI's header wins where a server sends both
    both = {"x-ratelimit-limit-requests": "60", "anthropic-ratelimit-requests-limit": "50"}
    assert RateLimitHeaders.from_headers(both).limit_requests == 60


def test_a_529_is_refused_for_rate_as_a_429_is():
    assert Feedback.from_http(529, {}).rate_limited and Feedback.from_http(429, {}).rate_limited
    assert not Feedback.from_http(503, {}).rate_limited
