"""What the docs point at exists: every link to a heading lands on one, every results JSON a doc names is
under benchmarks/results, and every JSON there is named by a doc (the table it is published from)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation (backticks included) dropped, spaces to
    hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '#' in a code block is no heading
    return {github_anchor(heading) for heading in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_every_link_to_a_heading_lands_on_one():
    broken = []
    for doc in DOCS:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", doc.read_text()):
            page = (doc.parent / target).resolve() if target else doc
            if not page.is_file() or anchor not in anchors(page):
                broken.append(f"{doc.relative_to(ROOT)}: {target}#{anchor}")
    assert not broken, broken


def test_the_results_json_and_the_docs_name_each_other():
    named = {name for doc in DOCS for name in re.findall(r"results/([\w.-]+\.json)", doc.read_text())}
    present = {path.name for path in RESULTS.glob("*.json")}
    assert named - present == set(), "named by a doc, missing from benchmarks/results"
    assert present - named == set(), "in benchmarks/results, published in no doc"
