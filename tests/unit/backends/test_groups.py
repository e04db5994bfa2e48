"""Group judging's pure parts: grouping, balanced splits, rendering, reply parsing; ensembles."""

from __future__ import annotations

import doctest
import json
import math

import pytest

from qreward_queue.backends import groups
from qreward_queue.backends.groups import (
    DEFAULT_GROUP_TEMPLATE,
    DEFAULT_TAGGED_PATTERN,
    group_indices,
    parse_group_scores,
    pattern_problem,
    plan_groups,
    render_group,
    split_balanced,
    template_problem,
)
from qreward_queue.backends.injection import fence
from qreward_queue.errors import InvalidSamples, PermanentError, TransientError
from qreward_queue.planning import ensemble
from qreward_queue.planning.ensemble import Vote, aggregate, majority


@pytest.mark.parametrize("module", [groups, ensemble])
def test_doctests(module) -> None:
    failed, tried = doctest.testmod(module)
    assert tried > 0 and failed == 0


def test_groups_by_explicit_key_else_by_prompt_in_first_seen_order() -> None:
    samples = [
        {"prompt": "b", "response": "1"},
        {"prompt": "a", "response": "2", "group": "g"},
        {"prompt": "a", "response": "3"},
        {"prompt": "b", "response": "4"},
        {"prompt": "a", "response": "5", "group": "g"},
        {"prompt": "a", "response": "6", "group": 0},
    ]
    assert group_indices(samples) == [[0, 3], [1, 4], [2], [5]]


def test_a_group_with_two_prompts_or_a_bad_group_value_is_named_per_sample() -> None:
    samples = [
        {"prompt": "a", "group": "g"},
        {"prompt": "b", "group": "g"},
        {"prompt": "a", "group": [1]},
        {"prompt": "a", "group": True},
    ]
    with pytest.raises(InvalidSamples) as caught:
        group_indices(samples)
    assert sorted(caught.value.problems) == [1, 2, 3]
    assert "another prompt than sample 0" in caught.value.problems[1]
    assert "got list" in caught.value.problems[2] and "got bool" in caught.value.problems[3]


@pytest.mark.parametrize("n", range(0, 40))
@pytest.mark.parametrize("max_size", [1, 3, 8])
def test_balanced_split_keeps_order_and_sizes_within_one(n: int, max_size: int) -> None:
    parts = split_balanced(range(n), max_size)
    assert [i for part in parts for i in part] == list(range(n))
    sizes = [len(part) for part in parts]
    assert max(sizes) <= max_size and max(sizes) - min(sizes) <= 1
    assert len(parts) == max(1, math.ceil(n / max_size))  # as few calls as the maximum allows


def test_plan_splits_each_group_on_its_own() -> None:
    samples = [{"prompt": "a"}] * 9 + [{"prompt": "b"}] * 2
    assert plan_groups(samples, 8) == [[0, 1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    with pytest.raises(ValueError, match="max_size"):
        split_balanced([1], 0)


def test_render_puts_the_prompt_once_and_numbers_every_response() -> None:
    group = [{"prompt": "P?", "response": f"line {i}\nmore", "reference": "R"} for i in (1, 2, 3)]
    text = render_group(DEFAULT_GROUP_TEMPLATE, group)
    assert text.count("P?") == 1 and "Reference: R" in text and "each of the 3 responses" in text
    tag = fence([s["response"] for s in group])
    for n in (1, 2, 3):
        assert f'<{tag} id="{n}">\nline {n}\nmore\n</{tag}>' in text


def test_pattern_problem_wants_two_groups() -> None:
    assert pattern_problem(DEFAULT_TAGGED_PATTERN) is None
    assert "two capture groups" in pattern_problem(r"Score: (\d+)")
    assert "valid regex" in pattern_problem("(")


def test_template_problem_names_what_is_missing() -> None:
    assert template_problem(DEFAULT_GROUP_TEMPLATE) is None
    assert "{responses}" in template_problem("Rate {prompt}")
    assert "valid format string" in template_problem("{responses} {nope}")


@pytest.mark.parametrize(
    ("reply", "pattern", "want"),
    [
        ("[0.1, 0.5, 1]", None, [0.1, 0.5, 1.0]),
        ("I compared them.\n```json\n[0.1, 0.5, 1]\n```", None, [0.1, 0.5, 1.0]),
        ('Scores: {"3": 1, "1": 0.1, "2": 0.5}', None, [0.1, 0.5, 1.0]),
        ('Scores: ["0.1", "0.5", "1"]', None, [0.1, 0.5, 1.0]),
        ("[3] Score: 1\n[1] Score: 0.1\n[2] Score: .5", DEFAULT_TAGGED_PATTERN, [0.1, 0.5, 1.0]),
        ("<2>0.5</2><1>0.1</1><3>1</3>", r"<(\d+)>([^<]*)<", [0.1, 0.5, 1.0]),
    ],
)
def test_parse_one_score_per_response(reply: str, pattern: str | None, want: list[float]) -> None:
    assert parse_group_scores(reply, 3, pattern) == want


LONG = "x" * 2000


@pytest.mark.parametrize(
    ("reply", "pattern", "why"),
    [
        ("[0.1, 0.5]", None, "gives 2 scores for 3 responses"),
        ("[0.1, 0.5, 1, 0]", None, "gives 4 scores for 3 responses"),
        ('{"1": 0.1, "1": 0.5, "3": 1}', None, "scores response 1 twice"),
        ('{"0": 0.1, "1": 0.5, "2": 1}', None, "scores response '0', not one of 1..3"),
        ('{"1": 0.1, "2": 0.5}', None, "gives 2 scores for 3 responses (none for response 3)"),
        ('{"a": 0.1, "2": 0.5, "3": 1}', None, "scores response 'a'"),
        ('[0.1, "n/a", 1]', None, "score of response 2 ('n/a') is not a number"),
        ("[0.1, NaN, 1]", None, "score of response 2 (nan) is not a finite number"),
        ("[0.1, 1e999, 1]", None, "score of response 2 (inf) is not a finite number"),
        ("[0.1, true, 1]", None, "score of response 2 (True) is not a number"),
        ("[0.1, [0.5], 1]", None, "score of response 2 ([0.5]) is not a number"),
        ("[0.1, 0.5, 1] and that is final", None, "does not end with a JSON list or object"),
        ("I cannot decide.", None, "does not end with a JSON list or object"),
        ("[1] Score: 0.5", None, "does not end with a JSON list or object"),
        ("[1] Score: 0.1\n[2] Score: n/a\n[3] Score: 1", DEFAULT_TAGGED_PATTERN,
         "score of response 2 ('n/a') is not a number"),
        ("[1] Score: 0.1\n[3] Score: 1", DEFAULT_TAGGED_PATTERN, "none for response 2"),
        ("[" + LONG + "]", None, "does not end with a JSON list or object"),
    ],
)
def test_parse_rejects_anything_but_one_valid_score_each(reply: str, pattern, why: str) -> None:
    with pytest.raises(PermanentError) as caught:
        parse_group_scores(reply, 3, pattern)
    assert why in str(caught.value)
    assert caught.value.status == "error"
    quoted = caught.value.detail  # the reply, quoted for the outcome's detail
    assert quoted == reply if len(reply) <= 500 else (
        quoted.startswith(reply[:150]) and quoted.endswith(reply[-350:]) and "[...]" in quoted)


def test_parse_checks_the_score_range() -> None:
    assert parse_group_scores("[1, 5]", 2, score_range=(1, 5)) == [1.0, 5.0]
    with pytest.raises(PermanentError, match=r"response 2 \(6\) is outside score_range \[1, 5\]"):
        parse_group_scores("[1, 6]", 2, score_range=(1, 5))


def test_majority_is_the_mode_ties_go_to_the_median_of_the_tied() -> None:
    assert majority([3, 3, 5, 5, 5, 1]) == 5
    assert majority([1, 1, 5, 5, 2]) == 3  # 1 and 5 tie: their median
    assert majority([0.3, 0.1, 0.2]) == 0.2  # all differ: the median


@pytest.mark.parametrize(
    ("how", "want"), [("mean", 0.5), ("median", 0.4), ("majority", 0.4), ("min", 0.2)]
)
def test_aggregate_excludes_failed_votes_and_keeps_every_vote(how: str, want: float) -> None:
    votes = [Vote("a", 0.2), Vote("b", TransientError("HTTP 503")), Vote("c", 0.9),
             Vote("d", 0.4)]
    score, detail = aggregate(votes, how, quorum=3)
    assert score == pytest.approx(want)
    assert detail["failed"] == 1 and detail["spread"] == pytest.approx(0.7)
    assert detail["votes"][1] == {"judge": "b", "status": "error", "error": "HTTP 503"}
    assert [v.get("score") for v in detail["votes"]] == [0.2, None, 0.9, 0.4]
    json.dumps(detail)  # it goes into the outcome's detail as JSON


def test_below_quorum_is_an_error_naming_the_count_with_every_vote_in_detail() -> None:
    votes = [Vote("a", 0.2), Vote("b", TransientError("timeout")), Vote("c", PermanentError("x"))]
    with pytest.raises(PermanentError, match=r"1 of 3 judges scored, the quorum is 2 \(2 failed\)"
                       ) as caught:
        aggregate(votes, "median", quorum=2)
    assert caught.value.status == "error"
    assert [v["judge"] for v in json.loads(caught.value.detail)["votes"]] == ["a", "b", "c"]
    with pytest.raises(PermanentError, match="0 of 0"):
        aggregate([], "mean")


def test_aggregate_rejects_unknown_names_and_a_zero_quorum() -> None:
    with pytest.raises(ValueError, match="unknown aggregate 'mode'"):
        aggregate([Vote("a", 1.0)], "mode")
    with pytest.raises(ValueError, match="quorum must be at least 1"):
        aggregate([Vote("a", 1.0)], "mean", quorum=0)
