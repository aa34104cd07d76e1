"""The documentation: `docs/` builds as a site without warnings, every relative link in
README.md and docs/ resolves (to a file, and an `#anchor` to a heading of it), and every
code block marked runnable (a ```python block right after a `<!-- runnable -->` line) runs
as printed, in a new Python process in an empty folder."""

from __future__ import annotations

import csv
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
MARK = "<!-- runnable -->"
RUNNABLE = re.compile(r"^<!-- runnable -->\n```python\n(.*?)^```\s*$", re.S | re.M)


def runnable_blocks(pages: list[Path] = PAGES, root: Path = ROOT) -> list[tuple[str, str]]:
    """(page:line of the mark, the block's code) for every block marked runnable."""
    blocks = []
    for page in pages:
        text = page.read_text()
        for m in RUNNABLE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            blocks.append((f"{page.relative_to(root)}:{line}", m.group(1)))
    return blocks


def _prose(text: str) -> str:
    """The page without code blocks and inline code (their brackets are not links)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """The anchor a heading gets: mkdocs' default toc slug, which GitHub's matches for
    headings of words, spaces, hyphens and punctuation."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return re.sub(r"[-\s]+", "-", text).strip("-")


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in HEADING.findall(FENCE.sub("", page.read_text()))}


def _links(page: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(_prose(page.read_text()))]


def test_mkdocs_builds_strict(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (it is in the dev extra)")
    site = tmp_path / "site"
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", "mkdocs.yml", "-d", str(site)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "WARNING" not in run.stderr, run.stderr
    for page in ("index", "architecture", "passes", "options", "benchmarks", "ideas"):
        assert (site / page / "index.html").is_file() or (site / f"{page}.html").is_file(), page


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_link_checker_catches_broken_links(tmp_path: Path) -> None:
    """The checker itself: a missing file and a missing anchor are both reported."""
    (tmp_path / "a.md").write_text("# Title One\n\n## Second `part`\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#title-one) [ok2](a.md#second-part) [bad](missing.md) [bad2](a.md#nope)\n"
        "`[code](not-a-link.md)`\n```\n[fenced](not-a-link.md)\n```\n"
    )
    assert _links(page) == ["a.md#title-one", "a.md#second-part", "missing.md", "a.md#nope"]
    assert _anchors(tmp_path / "a.md") == {"title-one", "second-part"}


def test_readme_is_short_and_keeps_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    first_block = readme.split("```bash", 1)[1].split("```", 1)[0]
    assert "bash scripts/setup.sh" in first_block and "bash scripts/test.sh" in first_block


def test_benchmark_history_is_data() -> None:
    """Earlier figures live in data files with their date, commit and CPU, not a diary."""
    assert not (ROOT / "benchmarks" / "HISTORY.md").exists()
    with open(DOCS / "benchmarks" / "history" / "runs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    columns = ["date", "commit", "cpu", "workload", "backend", "metric", "value", "command"]
    assert rows and all(c in rows[0] for c in columns)
    for row in rows:
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", row["date"]), row
        assert re.fullmatch(r"[0-9a-f]{7}", row["commit"]), row
        assert row["cpu"] and row["metric"] and row["value"] and row["command"], row


def test_every_runnable_mark_opens_a_python_block(tmp_path: Path) -> None:
    """A mark a block does not follow (or a block that is not Python) is an error, not a
    block left unrun; the README's "Use" example is one of the runnable blocks."""
    marks = sum(line == MARK for page in PAGES for line in page.read_text().splitlines())
    blocks = runnable_blocks()
    assert marks == len(blocks), f"{marks} marks, {len(blocks)} runnable blocks: {blocks}"
    assert any(where.startswith("README.md") and "ORTTrainer" in code for where, code in blocks)
    page = tmp_path / "docs" / "x.md"
    page.parent.mkdir()
    page.write_text(f"{MARK}\n```python\nprint(1)\n```\n\n{MARK}\n```bash\nls\n```\n")
    assert runnable_blocks([page], tmp_path) == [("docs/x.md:1", "print(1)\n")]


@pytest.mark.slow
@pytest.mark.parametrize("where,code", runnable_blocks(), ids=[w for w, _ in runnable_blocks()])
def test_runnable_block_runs_as_printed(where: str, code: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ""},  # the installed ortrain, as a user has it
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{where} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
