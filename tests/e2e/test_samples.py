"""Sample validation names every bad index and why; Outcome records survive JSON round-trips."""

from __future__ import annotations

import json
import math

import pytest

from qreward_queue.errors import InvalidSamples
from qreward_queue.samples import (
    MAX_NESTING,
    STATUSES,
    Outcome,
    sample_problem,
    validate_samples,
)


def good(i: int = 0, **more) -> dict:
    return {"prompt": f"p{i}", "response": f"r{i}", **more}


def nested(levels: int) -> dict:
    """An object `levels` objects deep: {"a": {"a": ... {}}}."""
    value: dict = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


def self_containing() -> dict:
    value: dict = {}
    value["me"] = value
    return value


def doubling(levels: int) -> list:
    """A list of two references to the same list, `levels` deep: 2**levels values."""
    value: list = []
    for _ in range(levels):
        value = [value, value]
    return value


BAD = {
    "not a dict": (["prompt", "response"], "expected a dict", "got list"),
    "none": (None, "expected a dict", "got NoneType"),
    "missing prompt": ({"response": "r"}, "missing field 'prompt'", ""),
    "missing response": ({"prompt": "p"}, "missing field 'response'", ""),
    "int response": ({"prompt": "p", "response": 3}, "field 'response' must be a string", "int"),
    "none prompt": ({"prompt": None, "response": "r"}, "field 'prompt' must be a string", ""),
    "list reference": (good(reference=["4"]), "field 'reference' must be a string", "list"),
    "int data_source": (good(data_source=7), "field 'data_source'", "int"),
    "extra list": (good(extra=[1, 2]), "field 'extra' must be a JSON object", "list"),
    "extra str": (good(extra="{}"), "field 'extra' must be a JSON object", "str"),
    "extra set": (good(extra={"s": {1, 2}}), "not JSON-serializable", "set"),
    "extra bytes": (good(extra={"b": b"x"}), "not JSON-serializable", "bytes"),
    "nan in extra": (good(extra={"x": math.nan}), "not JSON-serializable", "Out of range"),
    "inf id": (good(id=math.inf), "not JSON-serializable", ""),
    "unknown field": (good(respones="typo"), "unknown field(s) 'respones'", ""),
    "two unknown": (good(zz=1, aa=2), "unknown field(s) 'aa', 'zz'", ""),
    # before: RecursionError out of json.dumps, which sank the whole batch
    "extra 995 deep": (good(extra=nested(995)), "field 'extra' is nested more than 100", ""),
    "extra 101 deep": (good(extra=nested(MAX_NESTING + 1)), "nested more than 100 levels", ""),
    "id 995 deep": (good(id=[nested(994)]), "field 'id' is nested more than 100", ""),
    "extra holds itself": (good(extra=self_containing()), "nested more than 100 levels", ""),
    "2**60 values": (good(extra={"l": doubling(60)}), "field 'extra' holds more than 524288",
                     "over the 1048576-byte cap"),
    "a million values": (good(extra={"l": [0] * 1_000_000}), "holds more than 524288", ""),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_each_problem_is_named(name):
    sample, reason, detail = BAD[name]
    why = sample_problem(sample)
    assert why is not None and reason in why and detail in why, why


@pytest.mark.parametrize(
    "sample",
    [
        good(),
        good(reference="4", data_source="gsm8k", extra={"k": [1, {"a": None}]}, id="x-1"),
        good(reference=None, data_source=None, extra=None, id=None),
        good(id=17),
        {"prompt": "", "response": ""},
        {"prompt": "é 漢字 \U0001f600", "response": "\x00"},
        good(extra=nested(MAX_NESTING), id=[[1]]),
    ],
)
def test_good_samples_pass(sample):
    assert sample_problem(sample) is None
    assert validate_samples([sample]) == {}


def test_invalid_samples_lists_every_bad_index_and_why():
    names = sorted(BAD)
    batch, bad_at = [], {}
    for k, name in enumerate(names):
        batch.append(good(k))  # a good one before each bad one
        bad_at[len(batch)] = name
        batch.append(BAD[name][0])
    with pytest.raises(InvalidSamples) as info:
        validate_samples(batch)
    problems = info.value.problems
    assert sorted(problems) == sorted(bad_at)
    message = str(info.value)
    assert message.startswith(f"{len(bad_at)} invalid sample(s):")
    for index, name in bad_at.items():
        assert BAD[name][1] in problems[index]
        assert f"sample {index}: {problems[index]}" in message
    assert list(problems) == sorted(problems)  # reported in index order


def test_collect_instead_of_raise():
    problems = validate_samples([good(), {"prompt": "p"}, good(1)], raise_errors=False)
    assert problems == {1: "missing field 'response'"}


@pytest.mark.parametrize(
    ("samples", "kind"),
    [
        ({"prompt": "p", "response": "r"}, "dict"),
        ("prompt,response", "str"),
        (b"{}", "bytes"),
        (None, "NoneType"),
        (42, "int"),
        ({"p", "r"}, "set"),
        ((good() for _ in range(2)), "generator"),
    ],
)
def test_samples_must_be_a_list(samples, kind):
    with pytest.raises(InvalidSamples) as info:
        validate_samples(samples)
    assert "samples must be a list of dicts" in str(info.value)
    assert f"got {kind}" in str(info.value)


def test_tuple_and_empty_list_are_accepted():
    assert validate_samples((good(), good(1))) == {}
    assert validate_samples([]) == {}


def test_size_cap():
    sample = good(extra={"blob": "x" * 1000})
    # the UTF-8 size of the text fields plus the JSON of `extra` and `id`
    text = sum(len(v.encode()) for k, v in sample.items() if k not in ("extra", "id"))
    rest = {k: sample[k] for k in ("extra", "id") if k in sample}
    size = text + len(json.dumps(rest))
    assert sample_problem(sample, max_bytes=size) is None  # exactly at the cap is fine
    why = sample_problem(sample, max_bytes=size - 1)
    assert why == f"{size} bytes exceeds the {size - 1}-byte cap per sample"
    with pytest.raises(InvalidSamples) as info:
        validate_samples([good(), sample], max_bytes=size - 1)
    assert list(info.value.problems) == [1]


def test_size_counts_utf8_bytes_not_characters():
    sample = {"prompt": "", "response": "漢" * 100}  # 3 bytes each in UTF-8
    size = 300
    assert sample_problem(sample, max_bytes=size) is None
    assert "exceeds" in sample_problem(sample, max_bytes=size - 1)


def test_unknown_keys_of_mixed_types_are_reported_not_crashed():
    problems = validate_samples([good(), {**good(), 1: "a", "zz": "b"}], raise_errors=False)
    assert list(problems) == [1] and "unknown field" in problems[1]


# --- Outcome --------------------------------------------------------------------------------


def test_outcome_round_trips_through_json():
    outcome = Outcome(
        score=0.42,
        status="error",
        backend="judge-a",
        attempts=3,
        latency_ms=12.5,
        error="server error 500",
        detail="Score: ?",
        id={"row": 7},
    )
    data = json.loads(json.dumps(outcome.to_dict()))
    assert Outcome.from_dict(data) == outcome
    assert set(data) == {
        "score",
        "status",
        "backend",
        "attempts",
        "latency_ms",
        "error",
        "detail",
        "id",
    }


def test_outcome_from_dict_ignores_extra_keys_and_defaults_missing_ones():
    outcome = Outcome.from_dict({"index": 3, "score": 1.0, "status": "cached"})
    assert outcome == Outcome(score=1.0, status="cached")
    assert outcome.scored


@pytest.mark.parametrize("status", STATUSES)
def test_only_backend_scores_count_as_scored(status):
    assert Outcome(0.0, status).scored == (status in ("ok", "cached"))


def test_errors_map_one_to_one_onto_statuses_and_placed_applies_the_fallback():
    from qreward_queue.errors import (
        DeadlineExceeded,
        LimiterBusy,
        PermanentError,
        RateLimited,
        TransientError,
    )

    for error, status in [(PermanentError("bad"), "error"), (TransientError("5xx"), "error"),
                          (RateLimited("429"), "error"), (LimiterBusy(3.0, "rpm"), "error"),
                          (DeadlineExceeded("late"), "timeout")]:
        failed = Outcome.failed(error, "judge", 2, note=" (gave up)")
        assert (failed.status, failed.score, failed.error) == (status, None, f"{error} (gave up)")
        placed = failed.placed("s7", fallback_score=-1.0)
        assert (placed.id, placed.score, placed.status) == ("s7", -1.0, status)
    assert Outcome(0.8, "ok").placed("s8", -1.0) == Outcome(0.8, "ok", id="s8")


def test_a_too_deep_sample_is_its_own_error_and_the_rest_of_the_batch_is_scored(
    tmp_path, redis_url, stack
):
    # Given a real worker on a mock judge, and a batch whose sample 1 has an `extra` 995
    # objects deep (before: RecursionError from validation, nothing scored)
    from support import expected, judge_backend, start_workers, write_config

    import qreward_queue
    from qreward_queue.testing.mock_judge import MockJudgeSettings, spawn

    judge = stack.enter_context(spawn(MockJudgeSettings(latency_ms=5)))
    config_path = write_config(tmp_path, {"j": judge_backend(judge.url)}, redis_url=redis_url)
    app = qreward_queue.configure(qreward_queue.load_config(config_path))
    (worker,) = start_workers(config_path, [("j", "deep@samples")])
    stack.callback(worker.kill)
    samples = [good(0), good(1, extra=nested(995)), good(2, extra={"fine": nested(50)})]
    # When it is submitted to raise: InvalidSamples names the sample and the limit
    with pytest.raises(InvalidSamples) as info:
        qreward_queue.submit_batch(samples, route="j", app=app)
    assert info.value.problems == {1: "field 'extra' is nested more than 100 levels deep"}
    # When it is submitted with on_invalid="outcome": that sample alone is an error
    outcomes = qreward_queue.submit_batch(samples, route="j", app=app, on_invalid="outcome",
                                          deadline_s=60).outcomes()
    assert [o.status for o in outcomes] == ["ok", "error", "ok"], outcomes
    assert "nested more than 100 levels deep" in outcomes[1].error
    assert [outcomes[i].score for i in (0, 2)] == [expected(app, "j", samples[i]) for i in (0, 2)]
