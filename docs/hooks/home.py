"""mkdocs hook: the site's home page is README.md, the repository's front door, as it is.

docs/index.md holds only a marker, so the front door is written once; README's links into
`docs/` become the site's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[2] / "README.md"
MARK = "<!-- generated: README.md -->"


def home_markdown() -> str:
    return README.read_text().replace("](docs/", "](")


def on_page_markdown(markdown: str, **_: Any) -> str:
    return markdown.replace(MARK, home_markdown()) if MARK in markdown else markdown
