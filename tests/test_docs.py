"""The documentation site builds without a warning (``sphinx-build -W``, what ``make docs``
runs), every internal link of it and of README.md leads to a page and an anchor that exist,
and the API reference lists every field of every config dataclass with its default.

No network is needed: external (http, https) links are not fetched (``linkcheck_ignore`` in
docs/conf.py says so too, for ``sphinx-build -b linkcheck``); internal ones are checked here,
on the built HTML, anchors included.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Dict, List, Set, Tuple
from urllib.parse import unquote, urlparse

import pytest

from conftest import ROOT

DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))
import configfields  # noqa: E402  (docs/_ext, the extension that writes the field tables)


@pytest.fixture(scope="module")
def html(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs") / "html"
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                           str(DOCS), str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    warnings = [line for line in proc.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    warnings = [w for w in warnings if "absl::InitializeLog" not in w]
    assert proc.returncode == 0 and not warnings, proc.stderr[-5000:]
    return out


class Links(HTMLParser):
    """The ids and the link targets of one HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: Set[str] = set()
        self.hrefs: List[str] = []
        self.images: List[str] = []

    def handle_starttag(self, tag: str, attrs) -> None:
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.hrefs.append(attrs["href"])
        if tag == "img" and attrs.get("src"):
            self.images.append(attrs["src"])


def parse(page: Path) -> Links:
    links = Links()
    links.feed(page.read_text())
    return links


def test_the_site_builds_without_warnings_and_has_every_page(html):
    for page in ("index", "getting-started", "guide/pytorch", "guide/tensorflow", "guide/ddp",
                 "guide/mixed-precision", "guide/checkpoints", "guide/many-hosts",
                 "guide/choosing", "guide/when-not", "algorithms", "api", "benchmarks"):
        assert (html / f"{page}.html").is_file(), page


def test_every_internal_link_of_the_site_leads_to_a_page_and_an_anchor(html):
    pages: Dict[Path, Links] = {p: parse(p) for p in html.rglob("*.html")}
    broken = []
    for page, links in pages.items():
        if page.parent.name in ("_modules", "_sources") or page.name in ("genindex.html", "search.html"):
            continue
        for href in links.hrefs + links.images:
            url = urlparse(href)
            if url.scheme or href.startswith("//"):
                continue  # external: not fetched
            target = (page.parent / unquote(url.path)).resolve() if url.path else page
            if not target.exists():
                broken.append(f"{page.relative_to(html)}: {href} (no such file)")
            elif url.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else parse(target).ids
                if unquote(url.fragment) not in ids:
                    broken.append(f"{page.relative_to(html)}: {href} (no such anchor)")
    assert not broken, "\n".join(broken)


def github_slug(title: str) -> str:
    """The anchor GitHub (and MyST's default) gives a Markdown heading."""
    text = re.sub(r"`|\*|\[|\]\([^)]*\)", "", title.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors_of(markdown: Path) -> Set[str]:
    anchors, fenced = set(), False
    for line in markdown.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            anchors.add(github_slug(line.lstrip("#")))
    return anchors


def test_every_link_of_the_readme_leads_to_a_file_and_a_heading():
    broken = []
    text = re.sub(r"```.*?```", "", (ROOT / "README.md").read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        url = urlparse(target)
        if url.scheme:
            continue
        path = ROOT / unquote(url.path) if url.path else ROOT / "README.md"
        if not path.exists():
            broken.append(f"{target} (no such file)")
        elif url.fragment and url.fragment not in anchors_of(path):
            broken.append(f"{target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_github_slugs_match_the_sites_anchors(html):
    """The README's anchors are GitHub's; the site gives every heading the same one."""
    page = DOCS / "guide" / "many-hosts.md"
    assert anchors_of(page) <= parse(html / "guide" / "many-hosts.html").ids


class Cells(HTMLParser):
    """The rows of the tables of an HTML fragment, as lists of cell texts."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: List[List[str]] = []
        self.cell = None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self.cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self.cell is not None:
            self.rows[-1].append(" ".join("".join(self.cell).split()))
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell.append(data)


def config_classes() -> List[type]:
    from horovod_dgc.core.config import CompressionConfig, GatheredConfig, SparseConfig
    from horovod_dgc.core.methods import METHODS
    from horovod_dgc.core.stats import CompressionStats
    return [spec.config for spec in METHODS] + [GatheredConfig, SparseConfig, CompressionConfig,
                                                CompressionStats]


def class_section(api: str, cls: type) -> str:
    anchor = f'id="{cls.__module__}.{cls.__qualname__}"'
    assert anchor in api, f"{cls.__qualname__} is missing from the API reference"
    start = api.index(anchor)
    end = api.find('<dl class="py class">', start)
    return api[start:end if end > 0 else len(api)]


def test_the_api_reference_lists_every_config_field_with_its_default(html):
    api = (html / "api.html").read_text()
    missing = []
    for cls in config_classes():
        cells = Cells()
        cells.feed(class_section(api, cls))
        rows = {row[0]: row for row in cells.rows if row}
        for field in dataclasses.fields(cls):
            row = rows.get(field.name)
            if row is None:
                missing.append(f"{cls.__qualname__}.{field.name}: no row")
            elif row[2] != configfields.default_text(field) or not row[3] or not row[4]:
                missing.append(f"{cls.__qualname__}.{field.name}: {row}")
    assert not missing, "\n".join(missing)


def test_the_api_reference_lists_every_factory_and_stats(html):
    from horovod_dgc.core.methods import METHODS
    api = (html / "api.html").read_text()
    for adapter in ("torch", "tensorflow"):
        for spec in METHODS:
            assert f'id="horovod_dgc.{adapter}.Compression.{spec.name}"' in api, (adapter, spec.name)
    assert 'id="horovod_dgc.torch.compression.MethodCompressor.stats"' in api
    assert 'id="horovod_dgc.tensorflow.MethodCompressor.stats"' in api


def test_a_field_without_a_description_or_a_unit_is_a_build_warning(monkeypatch, caplog):
    @dataclasses.dataclass(frozen=True)
    class Renamed:
        """A config whose new option nobody documented.

        Attributes:
            density: fraction sent.
        """
        density: float = 0.1
        new_option: float = 2.0

    said: List[Tuple[str, str]] = []

    class Logger:
        def warning(self, message, location=None):
            said.append((message, location))

    monkeypatch.setattr(configfields, "logger", Logger())
    table = configfields.field_table(Renamed, "Renamed")
    assert [m.split("Renamed.")[-1] for m, _ in said] == [
        "new_option has no description in any Attributes section of its classes",
        "new_option has no unit: add it to UNITS in docs/_ext/configfields.py"]
    assert "     - ``0.1``" in table and "     - fraction sent." in table
