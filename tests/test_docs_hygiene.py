"""README.md and docs/ say what is, not how it came to be: no issue numbers (``#NN``), no dated
history (a date stands only in the "measured on" column of a results table), no commit
hashes, and no paths of one machine (``/tmp/...``, a home directory) outside the shell
examples that need a temporary directory, which are named below. docs/data/ (the records of
the runs) is left as it was measured."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

from conftest import ROOT

DOCS = ROOT / "docs"

# Shell examples that need a temporary directory: (file, the text of the line that holds it).
TEMPORARY_DIRECTORY_EXAMPLES = {
    ("docs/guide/ddp.md",
     "python3.11 -m venv /tmp/ddp-only && /tmp/ddp-only/bin/pip install torch numpy . \\"),
    ("docs/guide/ddp.md", "  && /tmp/ddp-only/bin/torchrun --standalone --nproc-per-node 2 \\"),
}

ISSUE_NUMBER = re.compile(r"(?<![\w&/])#\d+\b")
DATE = re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b"
                  r"|\b\d{1,2} (?:January|February|March|April|May|June|July|August|September"
                  r"|October|November|December) (?:19|20)\d\d\b"
                  r"|\b(?:January|February|March|April|May|June|July|August|September|October"
                  r"|November|December) \d{1,2},? (?:19|20)\d\d\b"
                  r"|\b\d{1,2}:\d\d(?::\d\d)? UTC\b")
COMMIT = re.compile(r"\b(?:commit|commits|at|since|before|after|of) (?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])"
                    r"[0-9a-f]{7,40}\b")
MACHINE_PATH = re.compile(r"(?<![\w.~$-])(?:/tmp|/var/tmp|/home|/root|/work|/mnt|/scratch|/Users"
                          r"|/opt)/|\b[A-Z]:\\\\")


def documents() -> List[Path]:
    files = [ROOT / "README.md"]
    for path in sorted(DOCS.rglob("*")):
        relative = path.relative_to(DOCS).parts
        if path.is_file() and relative[0] not in ("data", "img") and path.suffix in (".md", ".py", ".txt"):
            files.append(path)
    return files


def table_cells(line: str) -> List[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def findings(name: str, text: str) -> Iterator[Tuple[int, str, str]]:
    """(line number, rule, line) for every line of ``text`` (the file ``name``, relative to
    the repository) that breaks a rule."""
    lines = text.splitlines()
    header: List[str] = []
    for number, line in enumerate(lines, 1):
        is_row = line.lstrip().startswith("|")
        if is_row and number < len(lines) and re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[number]):
            header = [cell.lower() for cell in table_cells(line)]  # the next line is |---|
        elif not is_row:
            header = []
        if ISSUE_NUMBER.search(line):
            yield number, "an issue number", line
        if COMMIT.search(line):
            yield number, "a commit hash", line
        if MACHINE_PATH.search(line) and (name, line) not in TEMPORARY_DIRECTORY_EXAMPLES:
            yield number, "a path of a machine", line
        if DATE.search(line):
            cells = table_cells(line) if is_row and header else []
            dated = [i for i, cell in enumerate(cells) if DATE.search(cell)]
            allowed = (len(cells) == len(header) and dated
                       and all(header[i] == "measured on" for i in dated))
            if not allowed:
                yield number, "a date outside a results table's 'measured on' column", line


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_document_keeps_no_history_issue_numbers_or_machine_paths(path):
    name = str(path.relative_to(ROOT))
    found = [f"{name}:{number}: {rule}: {line.strip()}" for number, rule, line in
             findings(name, path.read_text())]
    assert not found, "\n".join(found)


def test_the_named_temporary_directory_examples_are_still_there():
    for name, line in TEMPORARY_DIRECTORY_EXAMPLES:
        assert line in (ROOT / name).read_text().splitlines(), (name, line)


@pytest.mark.parametrize("planted, rule", [
    ("Fixed in #13, as the issue asked.", "an issue number"),
    ("The decode got faster (see #15's criterion).", "an issue number"),
    ("Until 2026-11-28 it was silent.", "a date outside a results table's 'measured on' column"),
    ("Measured on 28 November 2026 on this machine.", "a date outside a results table's 'measured on' column"),
    ("A run at 12:10 UTC took longer.", "a date outside a results table's 'measured on' column"),
    ("| dgc | 0.8993 | 2026-11-26 |", "a date outside a results table's 'measured on' column"),
    ("The step went from 2.1 to 1.9 ms at commit 8e65024.", "a commit hash"),
    ("The script is in /tmp/prof/ab2.py.", "a path of a machine"),
    ("`python3 -m venv /tmp/ddp-only` elsewhere", "a path of a machine"),
])
def test_a_planted_line_is_found(planted, rule):
    text = "# A page\n\nSome text.\n\n" + planted + "\n"
    assert [r for _, r, _ in findings("docs/planted.md", text)] == [rule]


def test_a_date_in_the_measured_on_column_and_ordinary_text_pass():
    text = "\n".join([
        "| result | command | measured on |",
        "|---|---|---|",
        "| 5.98x faster | `make cluster-bench` | 2026-11-27 |",
        "",
        "See [the methods](algorithms.md#warm-up) and `x[I]`; ICLR 2018, arXiv:1712.01887.",
        "Colours `#fff`, HTML &#39; and the step `t * 2654435761` are not issues.",
        "The cache is `~/.cache/horovod_dgc/wheels/`; `/etc/netns/<name>` is the kernel's.",
    ])
    assert list(findings("docs/planted.md", text)) == []
