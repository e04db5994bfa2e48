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
