"""The documentation site: it builds with `mkdocs build --strict`, its generated references
cover the code, and in headless Chromium its home page and one page per section render with
every internal link answering (no 404, no missing anchor)."""

from __future__ import annotations

import dataclasses
import functools
import http.server
import re
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
from support import ROOT

from qreward_queue.backends import FunctionOptions, JudgeOptions, RewardModelOptions
from qreward_queue.cli.main import cli
from qreward_queue.config import model as settings

pytest.importorskip("mkdocs", reason="needs the docs extra: pip install -e '.[docs]'")
sys.path.insert(0, str(ROOT / "docs" / "hooks"))
import home
import reference

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# the home page and one page per section of mkdocs.yml's nav: (path, its <h1>)
PAGES = [
    ("", "qreward-queue (qrq)"),
    ("quickstart/", "Quickstart"),
    ("trainer-verl/", "verl"),
    ("configuration/", "Configuration"),
    ("cli/", "Command line"),
    ("flow-control/", "Flow control"),
    ("operations/", "Operations"),
    ("benchmarks/", "Benchmarks"),
    ("architecture/", "Architecture"),
    ("development/", "Development"),
]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                          str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def served(site) -> Iterator[str]:
    """The built site over HTTP on 127.0.0.1, as a browser reaches it."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


class _Page(HTMLParser):
    """What a rendered page holds: its title, h1 text, element ids and links."""

    def __init__(self) -> None:
        super().__init__()
        self.title = self.h1 = ""
        self.ids: set[str] = set()
        self.links: list[str] = []
        self._in: str | None = None

    def handle_starttag(self, tag, attrs) -> None:
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(values["id"])
        if tag == "a" and values.get("href"):
            self.links.append(values["href"])
        if tag in ("title", "h1") and not getattr(self, tag):
            self._in = tag

    def handle_endtag(self, tag) -> None:
        if tag == self._in:
            self._in = None

    def handle_data(self, data) -> None:
        if self._in:
            setattr(self, self._in, getattr(self, self._in) + data)


def rendered(url: str) -> _Page:
    """The page's DOM after headless Chromium ran its scripts."""
    cmd = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--window-size=1400,900", "--virtual-time-budget=5000", "--dump-dom", url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    page = _Page()
    page.feed(out.stdout)
    return page


def fetched(url: str) -> _Page:
    with urllib.request.urlopen(url, timeout=10) as reply:
        page = _Page()
        page.feed(reply.read().decode())
        return page


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium package")
@pytest.mark.parametrize("path, heading", PAGES)
def test_page_renders_in_a_browser_with_no_broken_link(served, path, heading):
    page = rendered(served + path)
    assert page.h1.strip().rstrip("¶").strip() == heading
    assert page.title.strip().endswith("qreward-queue (qrq)")
    assert len(page.ids) > 5  # the theme's navigation and the page's headings are there
    base = served + path
    internal = {urllib.parse.urljoin(base, link) for link in page.links}
    internal = {link for link in internal if link.startswith(served)}
    assert len(internal) > 20  # the whole navigation is linked from every page
    for link in sorted(internal):
        target, _, anchor = link.partition("#")
        try:
            linked = fetched(target)
        except urllib.error.HTTPError as exc:
            pytest.fail(f"{base}: link {link} answers {exc.code}")
        if anchor:
            assert urllib.parse.unquote(anchor) in linked.ids, f"{base}: no #{anchor} at {target}"


def test_home_page_is_the_readme(site):
    home_html = (site / "index.html").read_text()
    assert "Your own judge in three steps" in home_html
    assert 'href="quickstart/#the-tests"' in home_html  # README's docs/ links made the site's
    assert "](docs/" in (ROOT / "README.md").read_text() and "](docs/" not in home.home_markdown()


def test_cli_reference_has_every_command(site):
    page = (site / "cli" / "index.html").read_text()
    for name in cli.commands:
        assert f"qrq {name}" in page, name


def test_configuration_reference_has_every_setting(site):
    classes = [c for c in vars(settings).values()
               if dataclasses.is_dataclass(c) and dataclasses.fields(c)]  # not KindOptions
    assert sorted(c.__name__ for c in classes) == sorted(reference.TABLES)  # none left out
    kinds = list(reference.kind_tables().values())
    assert {JudgeOptions, RewardModelOptions, FunctionOptions} <= set(kinds)
    classes += kinds
    generated = reference.settings_reference()
    page = (site / "configuration" / "index.html").read_text()
    for cls in classes:
        for field in dataclasses.fields(cls):
            assert f"| `{field.name}` |" in generated, f"{cls.__name__}.{field.name}"
        assert f"<code>{cls.__name__}</code>" in page
    assert re.search(r"<code>max_pause_s</code></td>\s*<td><code>float</code>", page)


def test_environment_table_names_every_variable_the_package_reads():
    source = "\n".join(p.read_text() for p in (ROOT / "qreward_queue").rglob("*.py"))
    reads = r"""(?:environ(?:\.get)?\(|getenv\(|environ\[|envvar=)\s*["']([A-Z_]+)["']"""
    read = set(re.findall(reads, source))
    read |= set(re.findall(r"\b(QRQ_[A-Z_]+)\b", source))
    table = (ROOT / "docs" / "configuration.md").read_text().split("## Environment variables")[1]
    assert {"QRQ_REDIS_URL", "QRQ_CONFIG", "WORLD_SIZE"} <= read  # the scan finds them
    missing = sorted(v for v in read if f"`{v}`" not in table and v not in IGNORED_ENV)
    assert not missing


# read by code but not a setting of qrq's: the OS's (PATH, HOME), a child's environment
IGNORED_ENV = {"PATH", "HOME", "PYTHONPATH", "HTTP_AUTHORIZATION", "QRQ_"}


def test_no_page_shows_markdown_it_did_not_render(site):
    """A fence or a list item Python-Markdown could not place (GitHub's renderer is looser)
    shows up as its source: ``` or a `- ` line inside a paragraph."""
    for page in sorted(site.rglob("*.html")):
        text = re.sub(r"<pre.*?</pre>", "", page.read_text(), flags=re.S)
        assert "```" not in text, page
        assert not re.search(r"<p>(?:[^<]|<(?!/p>))*\n- <", text), page
