"""mkdocs hook: the configuration reference, generated from the settings dataclasses.

A page holding `<!-- generated: settings -->` gets one table per dataclass of
`qreward_queue/config/model.py`, and one per kind's options dataclass (`backends.KINDS`):
field, type, default, the comment the source gives it, so the reference cannot drift from the
model the loader fills. The CLI reference comes from click
itself (the `mkdocs-click` extension, docs/cli.md).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from typing import Any

from qreward_queue.backends import KINDS
from qreward_queue.config import model as settings

MARK = "<!-- generated: settings -->"
# each dataclass and where its values are written
TABLES: dict[str, str] = {
    "Config": "`qrq.toml`: top level, `[redis]` and `[defaults]`",
    "Route": "`qrq.toml`: `[routes.NAME]`",
    "Audit": "`qrq.toml`: `[routes.NAME] audit = { ... }`",
    "GatewaySettings": "`qrq.toml`: `[gateway]`",
    "Jobs": "`qrq.toml`: `[jobs]`",
    "JobSettings": "`qrq.toml`: `[jobs.JOB]` (and `[jobs.JOB.budget]`)",
    "Backend": "`workers/<backend>.toml`: `[backend]`, the keys of every kind (and the kind's "
               "own, below)",
    "Limits": "`workers/<backend>.toml`: `[limits]`",
    "Pool": "`workers/<backend>.toml`: `[pool]`",
    "Retry": "`workers/<backend>.toml`: `[retry]`",
    "Price": "`workers/<backend>.toml`: `[price]`",
    "Budget": "`workers/<backend>.toml`: `[budget]`; `qrq.toml`: `[jobs.JOB.budget]` (or "
              "`[gateway.budget.JOB]`)",
}


def kind_tables() -> dict[str, type]:
    """Each kind's options dataclass and where its values are written."""
    return {f"`workers/<backend>.toml`: `[backend]` with `kind = \"{name}\"`": kind.Options
            for name, kind in KINDS.items() if dataclasses.fields(kind.Options)}


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in the source (of the class or the one it extends): on its line,
    else the lines just above it."""
    notes: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base) and base.__module__.startswith("qreward_queue"):
            notes |= _own_comments(base)
    return notes


def _own_comments(cls: type) -> dict[str, str]:
    source, _ = inspect.getsourcelines(cls)
    notes: dict[str, str] = {}
    above: list[str] = []
    for line in source:
        text = line.strip()
        if text.startswith("#"):
            above.append(text.lstrip("# "))
            continue
        match = re.match(r"(\w+): [^=#]+(?:=[^#]*)?(?:#\s*(.*))?$", text)
        if match and not text.startswith(("def ", "return ", "@")):
            notes[match.group(1)] = match.group(2) or " ".join(above)
        above = []
    return notes


def default_of(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if isinstance(value, str) and "\n" in value:
        return "(see the source)"
    text = repr(value) if not dataclasses.is_dataclass(value) else f"`{type(value).__name__}()`"
    return text if text.startswith("`") else f"`{text}`"


def table(cls: type, where: str) -> str:
    notes = field_comments(cls)
    doc = " ".join(ast.get_docstring(ast.parse(inspect.getsource(cls)).body[0]).split())  # type: ignore[arg-type]
    rows = [f"### `{cls.__name__}`\n", f"{where}. {doc}\n",
            "| field | type | default | note |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        kind = str(field.type).replace("|", "\\|")
        note = notes.get(field.name, "").replace("|", "\\|")
        default = default_of(field).replace("|", "\\|")
        rows.append(f"| `{field.name}` | `{kind}` | {default} | {note} |")
    return "\n".join(rows) + "\n"


def settings_reference() -> str:
    """Every settings dataclass as a table, in the order of TABLES, each kind's options after
    `Backend`."""
    parts = []
    for name, where in TABLES.items():
        parts.append(table(getattr(settings, name), where))
        if name == "Backend":
            parts += [table(cls, kind_where) for kind_where, cls in kind_tables().items()]
    return "\n".join(parts)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return markdown.replace(MARK, settings_reference()) if MARK in markdown else markdown
