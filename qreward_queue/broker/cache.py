"""Score cache and in-batch dedup, keyed by what makes a reward: the route's scoring setup
(backend kinds, models, templates, functions) and the sample's content (not its id)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import redis

from .. import keys
from ..backends import make_backend
from ..config.model import Config, Route
from ..samples import Outcome

_CONTENT_FIELDS = ("prompt", "response", "reference", "data_source", "extra")


def content_key(sample: dict) -> str:
    """Identical samples (ignoring `id`) share a key, so a batch scores each only once."""
    digest = hashlib.blake2b(digest_size=16)
    for name in _CONTENT_FIELDS[:-1]:
        digest.update(b"\x1f" + (sample.get(name) or "").encode("utf-8", "surrogatepass"))
    if sample.get("extra"):
        digest.update(b"\x1e" + json.dumps(sample["extra"], sort_keys=True).encode())
    return digest.hexdigest()


def unit_keys(samples: Sequence[dict], whole: list[list[int]]) -> dict[int, str]:
    """Each sample's dedup and cache key, by the units its route scores in one call (see
    `routing.units`). A sample alone: its `content_key`. A member of a judge's group: the
    group's content in order plus its place among identical members, since a group score
    depends on every response beside it, and a response given twice in one group is judged
    twice (dedup must never shrink the group the judge sees). An identical group elsewhere
    (in the batch or the cache) gets the same keys, so it is scored once, as a whole."""
    found: dict[int, str] = {}
    for unit in whole:
        if len(unit) == 1:
            found[unit[0]] = content_key(samples[unit[0]])
            continue
        members = [content_key(samples[i]) for i in unit]
        group = hashlib.blake2b("\x1d".join(members).encode(), digest_size=16).hexdigest()
        seen: dict[str, int] = {}
        for i, member in zip(unit, members, strict=True):
            seen[member] = seen.get(member, 0) + 1
            found[i] = f"{group}.{member}.{seen[member]}"
    return found


def reward_identity(config: Config, route: Route) -> str:
    """Changes whenever a backend of the route would score differently: what its kind says
    decides its scores (`BackendClient.identity`: model, template...)."""
    parts = [route.name]
    if route.votes:  # an ensemble's score is its aggregate: every setting of it counts
        parts.append(json.dumps([route.votes, route.aggregate, route.quorum, route.temperature]))
    for name in route.backends:
        parts.append(json.dumps(make_backend(config.backend(name)).identity()))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


class ScoreCache:
    """Scores in Redis with a TTL; hits come back as `cached` outcomes without queueing."""

    def __init__(self, store: redis.Redis, identity: str, ttl_s: float):
        self.store, self.prefix, self.ttl_ms = store, keys.cache(identity), int(ttl_s * 1000)

    def get_many(self, keys: list[str]) -> dict[str, Outcome]:
        if not keys:
            return {}
        values = self.store.mget([self.prefix + k for k in keys])
        hits = {}
        for key, value in zip(keys, values, strict=True):
            if value is not None:
                data = json.loads(value)
                hits[key] = Outcome(data["score"], "cached", data.get("backend"))
        return hits

    def put_many(self, outcomes: dict[str, Outcome]) -> None:
        with self.store.pipeline(transaction=False) as pipe:
            for key, o in outcomes.items():
                pipe.set(self.prefix + key, json.dumps({"score": o.score, "backend": o.backend}),
                         px=self.ttl_ms)
            pipe.execute()


def record_cache(store: redis.Redis, route: str, lookups: int, hits: int) -> None:
    """Count a batch's cache lookups and hits in Redis, where `qrq exporter` reads them."""
    if lookups:
        with store.pipeline(transaction=False) as pipe:
            pipe.hincrby(keys.cache_stats(route), "lookups", lookups)
            pipe.hincrby(keys.cache_stats(route), "hits", hits)
            pipe.execute()
