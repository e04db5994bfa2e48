"""The priorities a batch is submitted at, and the broker's level for each.

str-valued, so `priority="val"` and `Priority.VAL` are the same thing everywhere (API, CLI,
integrations' metadata). On Redis, kombu serves level 0 first.
"""

from __future__ import annotations

from enum import Enum


class Priority(str, Enum):
    VAL = "val"  # validation: overtakes training work
    TRAIN = "train"
    BULK = "bulk"  # offline scoring: yields to both

    def __str__(self) -> str:
        return self.value

    @property
    def level(self) -> int:
        """The message priority kombu queues this at (0 is served first)."""
        return LEVELS[self]

    @classmethod
    def parse(cls, value: str) -> Priority:
        """`value` as a Priority, or a one-line error naming the choices."""
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(p.value for p in cls)
            raise ValueError(f"priority must be one of {choices}, got {value!r}") from None

    @classmethod
    def marked(cls, mark: object) -> Priority:
        """A sample's `qrq_priority` mark as trainer frameworks carry it: val, else train."""
        return cls.VAL if mark == cls.VAL else cls.TRAIN

    @classmethod
    def name_of(cls, level: int) -> str:
        """The priority queued at `level` (the bare number for a level qrq never uses)."""
        return next((p.value for p in cls if LEVELS[p] == level), str(level))


LEVELS = {Priority.VAL: 0, Priority.TRAIN: 6, Priority.BULK: 9}

# A worker stamps its task's level on the samples of its calls under this key, so that a
# judge with `priority_field` can send it as the request's `priority` (vLLM and SGLang serve
# lower values first, as the broker does: val before train before bulk).
CALL_LEVEL = "qrq_level"


def stamped(samples: list[dict], level: int | None) -> list[dict]:
    """`samples` carrying `level` (their task's message priority) under CALL_LEVEL."""
    return samples if level is None else [{**s, CALL_LEVEL: level} for s in samples]
