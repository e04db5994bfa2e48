"""The score_chunk message contract: kwargs are checked (and typed) before a task takes
anything; each broken field is named."""

from __future__ import annotations

import pytest

from qreward_queue.message import ChunkMessage, MalformedMessage, chunk_kwargs

GOOD = chunk_kwargs("j", [{"prompt": "p", "response": "r"}], ["j"], 1e10, "b1", [0], "team-a")


def test_a_client_message_round_trips() -> None:
    message = ChunkMessage.from_kwargs(GOOD)
    assert (message.backend, message.attempt, message.done, message.tried) == ("j", 1, None, [])
    again = ChunkMessage.from_kwargs(message.retried(attempt=2, done=[None]))
    assert (again.attempt, again.done, again.indices, again.job) == (2, [None], [0], "team-a")


def test_a_message_from_before_jobs_is_the_default_jobs() -> None:
    old = {k: v for k, v in GOOD.items() if k != "job"}
    assert ChunkMessage.from_kwargs(old).job == "default"


@pytest.mark.parametrize(("change", "named"), [
    ({"samples": "not a list"}, "samples must be a list of sample objects"),
    ({"samples": [1, 2]}, "samples must be a list of sample objects"),
    ({"indices": [0, 1]}, "indices must be a list of sample positions, one per sample"),
    ({"indices": ["0"]}, "indices must be a list of sample positions"),
    ({"attempt": "2"}, "attempt must be a whole number >= 1"),
    ({"attempt": 0}, "attempt must be a whole number >= 1"),
    ({"deadline": "soon"}, "deadline must be a number"),
    ({"deadline": float("nan")}, "deadline must be a number"),
    ({"route": "j"}, "route must be a list of backend names"),
    ({"done": [None, None]}, "done must be a list of outcome objects"),
    ({"backend": 7}, "backend must be a name"),
    ({"batch": None}, "batch and indices go together"),
    ({"extra": 1}, "unknown field(s) 'extra'"),
    ({"job": 7}, "job: expected a job's name: 1 to 64"),
    ({"job": "two words"}, "job: expected a job's name: 1 to 64"),
    ({"job": "x" * 65}, "job: expected a job's name: 1 to 64"),
])
def test_each_broken_field_is_named(change: dict, named: str) -> None:
    with pytest.raises(MalformedMessage, match=None) as raised:
        ChunkMessage.from_kwargs({**GOOD, **change})
    assert named in str(raised.value)


def test_kwargs_that_are_not_an_object_or_lack_a_backend_are_refused() -> None:
    with pytest.raises(MalformedMessage, match="kwargs must be an object"):
        ChunkMessage.from_kwargs([1])
    with pytest.raises(MalformedMessage, match="'backend' and 'samples' are required"):
        ChunkMessage.from_kwargs({"samples": []})
