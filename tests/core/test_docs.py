"""The docs describe the product: no process words anywhere users read, generated
references that match the code, a module map that names every module, links that resolve.

Regenerate the references with ``python -m commsched.bench.docgen``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# Words of how the work was done rather than of what the product does: issue and PR
# numbers, rounds and sessions of work, who ran what, the build machine's load.
PROCESS = re.compile(
    r"\bissues?\s*#?\d+"                       # issue 20, issues 17, issue #9
    r"|\(issue\b"                              # "(issue 9)", "(issue: ...)"
    r"|\bthe issue'?s\b"                       # "the goal"
    r"|\b(?:PR|pull request)\s*#?\d+"
    r"|(?<![\w/])#\d{2,}\b"                    # #29 (not an anchor or a colour)
    r"|(?<!ring )\bround \d+\b"                # round 3 (a ring round of an exchange is prose)
    r"|\b(?:last|previous|earlier) round\b"
    r"|\bsessions?\b"
    r"|\bquiet machine\b|\bload average\b"
    r"|\blatest measurement\b",
    re.IGNORECASE)

# the text files users read (docs, the README) and the code (docstrings, help, output)
def _files() -> list[Path]:
    out = sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]
    for folder in ("commsched", "kernels"):
        out += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".c", ".md"))
    return [p for p in out if p.exists()]


def _hits(lines, where: str) -> list[str]:
    return [f"{where}:{i}: {line.strip()[:120]}" for i, line in enumerate(lines, 1)
            if PROCESS.search(line)]


@pytest.mark.parametrize("text,bad", [
    ("see docs/benchmarks.md, issue 20", True), ("measured in round 3", True), ("round 3", True),
    ("(last round of issue 29)", True), ("in this session", True), ("goal (issue 9)", True),
    ("the issue's goal", True), ("On a quiet machine", True), ("timers on a loaded machine", False), ("load average 10", True),
    ("Issue 29: the compressed sums", True), ("fixed in #31", True), ("Latest measurement", True),
    ("the previous round", True), ("the variance of this round", False),
    # legitimate prose
    ("ring round 0 is the local copy", False), ("round i sends to rank+i", False),
    ("collectives issued in sequence order", False), ("every rank must issue the same", False),
    ("[GitHub issues](https://github.com/x/y/issues)", False), ("[Tests](#tests)", False),
    ("color #ff0000", False),
])
def test_the_pattern_catches_process_words_and_spares_prose(text, bad):
    assert bool(PROCESS.search(text)) is bad, text


def test_no_process_words_in_docs_readme_or_code():
    found = []
    for p in _files():
        found += _hits(p.read_text(errors="replace").splitlines(), str(p.relative_to(ROOT)))
    assert not found, "process words (say what the product does, not how it came about):\n" + "\n".join(found)


def test_no_process_words_in_any_help():
    from commsched.bench.docgen import commands

    found = []
    for c in commands():
        found += _hits(c.help().splitlines(), f"`{c.name} -h`")
    assert not found, "process words in help text:\n" + "\n".join(found)


def test_every_command_has_help_and_a_reference_entry():
    from commsched.bench.docgen import commands
    from commsched.bench.workloads import WORKLOADS

    names = [c.name for c in commands()]
    assert len(names) == len(set(names))
    for w in WORKLOADS:
        assert f"commsched bench {w}" in names
    for cmd in ("commsched", "commsched netem", "commsched partition", "commsched topology",
                "commsched demo", "python -m commsched.gnn.train", "python -m commsched.moe.train",
                "python -m commsched.moe.infer"):
        assert cmd in names


@pytest.mark.parametrize("page", ["cli.md", "api.md"])
def test_generated_references_match_the_code(page):
    from commsched.bench.docgen import PAGES, REGENERATE

    committed = (DOCS / page).read_text() if (DOCS / page).exists() else ""
    assert committed == PAGES[page](), f"docs/{page} differs from the code; run `{REGENERATE}`"


def _map_sections() -> dict[str, str]:
    """docs/design.md's module map: folder (``commsched/moe/model/``) -> its text."""
    block = (DOCS / "design.md").read_text().split("## The layout", 1)[1].split("```")[1]
    sections: dict[str, str] = {}
    folder = None
    for line in block.splitlines():
        if line and not line[0].isspace():
            folder, _, line = line.partition(" ")
            sections[folder] = ""
        if folder:
            sections[folder] += " " + line
    return sections


def test_the_module_map_names_every_module_in_its_folder_and_no_other():
    sections = _map_sections()
    modules = sorted(p for folder in ("commsched", "kernels") for p in (ROOT / folder).rglob("*.py")
                     if p.name != "__init__.py")
    missing = [str(p.relative_to(ROOT)) for p in modules
               if not re.search(r"(?<![\w./])" + re.escape(p.name) + r"\b",
                                sections.get(f"{p.parent.relative_to(ROOT)}/", ""))]
    assert not missing, "docs/design.md's module map lacks (in its folder): " + ", ".join(missing)
    stale = []
    for folder, text in sections.items():
        for name in re.findall(r"(?<![\w./])(\w+\.(?:py|c))\b", text):
            if folder == "tests/":
                exists = any((ROOT / "tests").rglob(name))
            else:
                exists = (ROOT / folder / name).exists()
            if not exists:
                stale.append(folder + name)
    assert not stale, "docs/design.md's module map names files that do not exist: " + ", ".join(stale)
    folders = {f"{p.parent.relative_to(ROOT)}/" for folder in ("commsched", "kernels")
               for p in (ROOT / folder).rglob("*.py")}
    assert sorted(folders - set(sections)) == [] and sorted(set(sections) - folders - {"tests/"}) == []


def test_links_between_pages_resolve():
    bad = []
    for p in sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]:
        for i, line in enumerate(p.read_text().splitlines(), 1):
            for target in re.findall(r"\]\(([^)\s#]+\.md)(?:#[^)]*)?\)", line):
                if target.startswith(("http://", "https://")):
                    continue
                # results.md: the page of current figures, written beside these guides
                if not (p.parent / target).exists() and target != "results.md":
                    bad.append(f"{p.relative_to(ROOT)}:{i}: {target}")
    assert not bad, "links to pages that do not exist:\n" + "\n".join(bad)


def test_links_into_the_results_page_name_a_row_or_a_section():
    page = (DOCS / "results.md").read_text()
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', page)) | {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+\s+(.*)$", page, re.M)}
    bad = []
    for p in sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]:
        for i, line in enumerate(p.read_text().splitlines(), 1):
            for anchor in re.findall(r"\]\((?:docs/)?results\.md#([^)\s]+)\)", line):
                if anchor not in anchors:
                    bad.append(f"{p.relative_to(ROOT)}:{i}: results.md#{anchor}")
    assert not bad, "links to rows or sections that results.md lacks:\n" + "\n".join(bad)
