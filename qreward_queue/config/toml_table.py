"""A TOML table that reports wrong or unknown keys with the file and the key's path."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, get_type_hints, overload

from ..errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_env(value: str, where: str) -> str:
    """Fill `${VAR}` / `${VAR:-default}` from the environment (for per-deployment hosts)."""

    def fill(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is None:
            raise ConfigError(f"{where}: environment variable {name} is not set (and no default)")
        return default

    return _ENV_REF.sub(fill, value)


def env_names(value: str) -> list[str]:
    """The variables `value` needs (`${VAR}`, without a `:-default`)."""
    return [m.group(1) for m in _ENV_REF.finditer(value) if m.group(2) is None]


class Table:
    """A TOML table that reports wrong or unknown keys with the file and the key's path.

    A file's tables share one list of problems, so `check` reports them all at once: a wrong
    optional value is noted and its default used; a wrong required one, or one the rest of
    its section depends on, stops that section only (`section`)."""

    def __init__(self, data: Any, source: str, path: str, problems: list[str] | None = None):
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: [{path}] must be a table, got {type(data).__name__}")
        self.data, self.source, self.path = data, source, path
        self.used: set[str] = set()
        self.problems = [] if problems is None else problems

    def note(self, problem: ConfigError) -> None:
        self.problems.append(str(problem))

    def section(self, key: str, parse: Callable[..., Any], *args: Any) -> Any:
        """`parse(table, *args)` on sub-table `key`; on its first hard error, None (noted)."""
        try:
            return parse(self.table(key), *args)
        except ConfigError as exc:
            self.note(exc)
            return None

    def check(self) -> None:
        """Raise one ConfigError listing every problem noted in this file, if any."""
        if self.problems:
            prefix = f"{self.source}: "
            raise ConfigError(prefix + "; ".join(p.removeprefix(prefix) for p in self.problems))

    def where(self, key: str) -> str:
        return f"{self.source}: {self.path}.{key}" if self.path else f"{self.source}: {key}"

    def fail(self, key: str, expected: str) -> ConfigError:
        return ConfigError(f"{self.where(key)}: expected {expected}, got {self.data.get(key)!r}")

    def get(
        self,
        key: str,
        kind: type | tuple[type, ...],
        default: Any = None,
        *,
        expected: str | None = None,
        required: bool = False,
    ) -> Any:
        self.used.add(key)
        if key not in self.data:
            if required:
                raise ConfigError(f"{self.where(key)}: missing (expected {expected or kind})")
            return default
        value = self.data[key]
        wrong_bool = isinstance(value, bool) and bool not in (
            kind if isinstance(kind, tuple) else (kind,))
        if wrong_bool or not isinstance(value, kind):
            problem = self.fail(key, expected or str(getattr(kind, "__name__", kind)))
            if required:
                raise problem
            self.note(problem)
            return default
        return value

    @overload
    def number(
        self, key: str, default: float, *, positive: bool = ..., allow_zero: bool = ...
    ) -> float: ...
    @overload
    def number(
        self, key: str, default: float | None, *, positive: bool = ..., allow_zero: bool = ...
    ) -> float | None: ...
    def number(
        self, key: str, default: float | None, *, positive: bool = True, allow_zero: bool = False
    ) -> float | None:
        value = self.get(key, (int, float), default, expected="a number")
        if value is None:
            return None
        if not math.isfinite(value):
            self.note(self.fail(key, "a finite number"))
            return default
        if positive and (value < 0 or (value == 0 and not allow_zero)):
            self.note(self.fail(key, "a positive number" if not allow_zero else "a number >= 0"))
            return default
        return float(value)

    @overload
    def integer(self, key: str, default: int, minimum: int = ...) -> int: ...
    @overload
    def integer(self, key: str, default: int | None, minimum: int = ...) -> int | None: ...
    def integer(self, key: str, default: int | None, minimum: int = 1) -> int | None:
        value: int | None = self.get(key, int, default, expected=f"an integer >= {minimum}")
        if value is not None and value < minimum:
            self.note(self.fail(key, f"an integer >= {minimum}"))
            return default
        return value

    def table(self, key: str) -> Table:
        self.used.add(key)
        return Table(self.data.get(key, {}), self.source, f"{self.path}.{key}".strip("."),
                      self.problems)

    def finish(self) -> None:
        for key in sorted(set(self.data) - self.used):
            self.note(ConfigError(
                f"{self.where(key)}: unknown key (known: {', '.join(sorted(self.used))})"))


T = TypeVar("T")


def read_fields(t: Table, cls: type[T], **given: Any) -> T:
    """The dataclass `cls` filled from `t` by its fields: each key read as its field's type
    (bool, int, float, str, a table, or one of these or None), a missing one its default (a
    field with none is required); a wrong value is noted and its default kept. A field's
    metadata may say what is `expected`, its `minimum` or its `choices`. `given` holds the
    values a kind read itself (keys with checks of their own, or read only in some cases)."""
    hints = get_type_hints(cls)
    values = dict(given)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in given and f.init:
            values[f.name] = _read_field(t, f, hints[f.name])
    return cls(**values)


def _read_field(t: Table, f: dataclasses.Field[Any], hint: Any) -> Any:
    default: Any = f.default
    if f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    required = default is dataclasses.MISSING
    options = [a for a in getattr(hint, "__args__", ()) if a is not type(None)] \
        if isinstance(hint, types.UnionType) else [hint]
    kind = getattr(options[0], "__origin__", options[0]) if len(options) == 1 else None
    expected = f.metadata.get("expected")
    value: Any
    if kind is int and not required:
        value = t.integer(f.name, default, f.metadata.get("minimum", 1))
    elif kind is float and not required:
        value = t.number(f.name, default, allow_zero=f.metadata.get("minimum", 1) == 0)
    elif kind in (bool, str, dict):
        value = t.get(f.name, kind, default, expected=expected or kind.__name__,
                      required=required)
    else:
        raise TypeError(f"{f.name}: a field of type {hint} is read by its kind (pass it given)")
    choices = f.metadata.get("choices")
    if choices is not None and value not in choices:
        raise t.fail(f.name, f"one of {', '.join(choices)}")
    return value


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            data: dict[str, Any] = tomllib.load(fh)  # tomli (Python 3.10) is not typed here
            return data
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc})") from None

