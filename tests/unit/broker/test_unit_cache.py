"""Unit tests of the score cache's keys and store (`qreward_queue/broker/cache.py`) on fakeredis."""

from __future__ import annotations

from dataclasses import replace

import fakeredis
import pytest

from qreward_queue import keys
from qreward_queue.backends import JudgeOptions
from qreward_queue.broker.cache import (
    ScoreCache,
    content_key,
    record_cache,
    reward_identity,
    unit_keys,
)
from qreward_queue.config.model import Backend, Config, Route
from qreward_queue.samples import Outcome

SAMPLE = {"id": "a", "prompt": "2+2?", "response": "4", "reference": "4",
          "data_source": "math", "extra": {"level": 1, "tags": ["x"]}}
JUDGE = Backend(name="judge-c", kind="judge", options=JudgeOptions(url="http://judge.invalid/v1",
                model="m-1"))
ROUTE = Route(name="graded", backends=("judge-c",), weights=(1.0,), cache=True)


@pytest.fixture
def store() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis(server=fakeredis.FakeServer())


def config_with(backend: Backend) -> Config:
    return Config(redis_url=None, backends={backend.name: backend}, routes={ROUTE.name: ROUTE})


# --------------------------------------------------------------------------------------------
# content_key and unit_keys


def test_content_key_ignores_the_id_and_the_order_of_extra():
    # Given the same sample under another id, its extra written in another order
    twin = dict(SAMPLE, id="b", extra={"tags": ["x"], "level": 1})
    # When both are keyed, Then they share the key
    assert content_key(twin) == content_key(SAMPLE)


@pytest.mark.parametrize("field", ["prompt", "response", "reference", "data_source"])
def test_content_key_changes_with_every_content_field(field):
    # Given the sample with one content field changed
    changed = dict(SAMPLE, **{field: SAMPLE[field] + "!"})
    # When both are keyed, Then the keys differ
    assert content_key(changed) != content_key(SAMPLE)


def test_content_key_tells_fields_apart_at_their_boundary():
    # Given two samples whose prompt and response join to the same text
    one = {"prompt": "ab", "response": "c"}
    other = {"prompt": "a", "response": "bc"}
    # When both are keyed, Then the keys differ
    assert content_key(one) != content_key(other)
    # And an extra that differs changes the key, an empty one is none at all
    assert content_key(dict(one, extra={"k": 1})) != content_key(dict(one, extra={"k": 2}))
    assert content_key(dict(one, extra={})) == content_key(one)


def test_a_sample_alone_is_keyed_by_its_content():
    # Given two samples scored alone
    samples = [SAMPLE, dict(SAMPLE, id="b", response="5")]
    # When their unit keys are made, Then each is its content key
    assert unit_keys(samples, [[0], [1]]) == {0: content_key(samples[0]),
                                              1: content_key(samples[1])}


def test_group_members_are_keyed_by_their_whole_group():
    # Given two groups with the same member beside different responses
    a = {"prompt": "p", "response": "a"}
    b = {"prompt": "p", "response": "b"}
    c = {"prompt": "p", "response": "c"}
    samples = [a, b, a, c]
    # When their unit keys are made
    found = unit_keys(samples, [[0, 1], [2, 3]])
    # Then the shared member is keyed differently in each group (its score depends on the rest)
    assert found[0] != found[2]
    assert len(set(found.values())) == 4


def test_an_identical_group_elsewhere_gets_the_same_keys():
    # Given the same group twice in one batch
    group = [{"prompt": "p", "response": "a"}, {"prompt": "p", "response": "b"}]
    # When their unit keys are made
    found = unit_keys(group + group, [[0, 1], [2, 3]])
    # Then the second group's keys are the first's, member by member
    assert (found[2], found[3]) == (found[0], found[1])


def test_a_response_given_twice_in_a_group_keeps_two_keys():
    # Given a group holding one response twice
    twice = [{"prompt": "p", "response": "a"}, {"prompt": "p", "response": "a"}]
    # When its unit keys are made, Then both members keep a key of their own (the group the
    # judge sees is never shrunk by dedup)
    found = unit_keys(twice, [[0, 1]])
    assert found[0] != found[1]


# --------------------------------------------------------------------------------------------
# reward_identity


@pytest.mark.parametrize("change", [
    {"model": "m-2"}, {"prompt_template": "Judge: {prompt} {response}"},
    {"system_prompt": "be strict"}, {"max_tokens": 32},
])
def test_the_identity_changes_when_the_reward_would_score_differently(change):
    # Given a route's judge, and the same judge with a setting that decides its scores changed
    before = reward_identity(config_with(JUDGE), ROUTE)
    # When the identity is made again, Then it differs
    changed = replace(JUDGE, options=replace(JUDGE.options, **change))
    assert reward_identity(config_with(changed), ROUTE) != before


def test_the_identity_stays_when_only_how_to_reach_the_judge_changes():
    # Given the same judge with a longer timeout, or at another address
    before = reward_identity(config_with(JUDGE), ROUTE)
    moved = replace(JUDGE, options=replace(JUDGE.options, url="http://judge-2.invalid/v1"))
    # When the identity is made again, Then it is the same (cached scores stay good)
    assert reward_identity(config_with(replace(JUDGE, timeout_s=120.0)), ROUTE) == before
    assert reward_identity(config_with(moved), ROUTE) == before


def test_the_identity_changes_with_the_route_and_its_ensemble():
    # Given the route, under another name, and as an ensemble
    config = config_with(JUDGE)
    before = reward_identity(config, ROUTE)
    # When their identities are made, Then every one differs
    renamed = reward_identity(config, replace(ROUTE, name="other"))
    voted = reward_identity(config, replace(ROUTE, votes=3))
    more_votes = reward_identity(config, replace(ROUTE, votes=5))
    assert len({before, renamed, voted, more_votes}) == 4


# --------------------------------------------------------------------------------------------
# ScoreCache and record_cache


def test_put_scores_come_back_as_cached_outcomes(store):
    # Given a cache with two scores put
    cache = ScoreCache(store, "id-1", ttl_s=60)
    cache.put_many({"k1": Outcome(0.5, "ok", "judge-c"), "k2": Outcome(1.0, "ok", "judge-d")})
    # When three keys are looked up
    hits = cache.get_many(["k1", "k2", "k3"])
    # Then the two put come back, marked cached and naming their backend; the third misses
    assert hits == {"k1": Outcome(0.5, "cached", "judge-c"),
                    "k2": Outcome(1.0, "cached", "judge-d")}
    assert cache.get_many([]) == {}


def test_scores_of_another_identity_are_not_shared(store):
    # Given a score cached under one identity
    ScoreCache(store, "id-1", ttl_s=60).put_many({"k1": Outcome(0.5, "ok", "judge-c")})
    # When another identity looks it up, Then it misses
    assert ScoreCache(store, "id-2", ttl_s=60).get_many(["k1"]) == {}


def test_cached_scores_expire_after_their_ttl(store):
    # Given a cache whose scores live 60 s
    cache = ScoreCache(store, "id-1", ttl_s=60)
    # When one is put
    cache.put_many({"k1": Outcome(0.5, "ok", "judge-c")})
    # Then its key expires within 60 s
    assert 55_000 < store.pttl(keys.cache("id-1") + "k1") <= 60_000


def test_record_cache_counts_lookups_and_hits_per_route(store):
    # Given two batches' lookups on one route, and a batch that looked nothing up
    record_cache(store, "graded", lookups=10, hits=4)
    record_cache(store, "graded", lookups=5, hits=5)
    record_cache(store, "other", lookups=0, hits=0)
    # Then the route's counts add up, and nothing is written for no lookups
    assert store.hgetall(keys.cache_stats("graded")) == {b"lookups": b"15", b"hits": b"9"}
    assert not store.exists(keys.cache_stats("other"))
