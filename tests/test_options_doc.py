"""docs/options.md holds what the code has: its tables are generated from ``TrainerOptions``
(``python -m ortrain.options_doc --write``) and list every field once; every environment
variable the page documents is read by the code; every option the README names exists."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from ortrain import TrainerOptions, options_doc

ROOT = Path(__file__).resolve().parents[1]
FIELDS = [f.name for f in dataclasses.fields(TrainerOptions)]


def test_the_page_is_generated_from_the_dataclass() -> None:
    page = options_doc.DOC.read_text()
    assert page == options_doc.render(page), (
        "docs/options.md is stale: run `python -m ortrain.options_doc --write`"
    )


def test_every_field_is_in_one_table_and_has_an_entry() -> None:
    listed = options_doc.listed(options_doc.DOC.read_text())
    twice = sorted({n for n in listed if listed.count(n) > 1})
    assert not twice, f"in two tables of docs/options.md: {twice}"
    assert sorted(listed) == sorted(FIELDS), (
        f"not in a table of docs/options.md: {sorted(set(FIELDS) - set(listed))}; "
        f"no such field: {sorted(set(listed) - set(FIELDS))}"
    )
    docs = options_doc.field_docs()
    missing, extra = sorted(set(FIELDS) - set(docs)), sorted(set(docs) - set(FIELDS))
    assert not missing and not extra, (
        f"TrainerOptions' docstring: no entry for {missing}, an entry for no field {extra}"
    )
    assert all(len(text) > 20 for text in docs.values())


def test_a_table_of_an_unknown_field_is_found() -> None:
    page = "<!-- options: device no_such_option -->\n<!-- end options -->\n"
    assert options_doc.listed(page) == ["device", "no_such_option"]
    row = options_doc.render("<!-- options: seed -->\nold\n<!-- end options -->\n")
    assert "| `seed` | `0` | seeds the graph's dropout masks" in row and "old" not in row


def test_documented_environment_variables_are_read_by_the_code() -> None:
    page = options_doc.DOC.read_text().split("## Environment variables", 1)[1]
    names = re.findall(r"^\| `(ORTRAIN_\w+)` \|", page, re.M)
    assert len(names) >= 5
    code = (
        "\n".join(
            p.read_text()
            for folder in ("ortrain", "graph_passes")
            for p in (ROOT / folder).rglob("*.py")
        )
        + (ROOT / "pyproject.toml").read_text()
        + (ROOT / "CMakeLists.txt").read_text()
    )
    unread = [n for n in names if n not in code]
    assert not unread, f"docs/options.md documents variables no code reads: {unread}"


def test_the_options_the_readme_names_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    brief = readme.split("## Options in brief", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z_]+)`", brief))
    assert {"device", "seed", "graph_cache"} <= named
    assert named <= set(FIELDS), (
        f"README's options that TrainerOptions lacks: {named - set(FIELDS)}"
    )
