"""The option tables of ``docs/options.md``, generated from ``TrainerOptions`` (one source
of truth, as ``docs/passes.md`` is generated from the pipeline).

Each table of the page sits between ``<!-- options: NAME NAME ... -->`` and
``<!-- end options -->``: the fields it lists, in that order. The rows come from the
dataclass (each field's default) and from the entries of ``TrainerOptions``' docstring
(``name: meaning``, continued on deeper-indented lines); the headings and prose around
the tables are written by hand.

``python -m ortrain.options_doc`` prints the page as it should be; ``--write`` writes it.
``tests/test_options_doc.py`` fails when the page is stale, when a field is in no table or
in two, or when a field has no entry (or an entry names no field).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from pathlib import Path

from ortrain.options import TrainerOptions

DOC = Path(__file__).resolve().parent.parent / "docs" / "options.md"
REGION = re.compile(r"(<!-- options: ([\w ]+) -->\n)(.*?)(<!-- end options -->)", re.S)
_ENTRY = re.compile(r"^(\w+): ", re.M)


def field_docs() -> dict[str, str]:
    """Field name -> its docstring entry, as one line of Markdown."""
    doc = inspect.cleandoc(TrainerOptions.__doc__ or "")
    entries: dict[str, str] = {}
    name = None
    for line in doc.splitlines():
        match = _ENTRY.match(line)
        if match and not line.startswith(" "):
            name = match.group(1)
            entries[name] = line[match.end() :]
        elif name is not None and line.startswith("    "):
            entries[name] += " " + line.strip()
        else:
            name = None  # a paragraph that is no entry
    return {k: _markdown(v) for k, v in entries.items()}


def _markdown(text: str) -> str:
    """reST-ish docstring text as Markdown: ``code`` and quoted values as code spans."""
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    return re.sub(r'(?<![`\w])"([^"\s]+)"(?![`\w])', r'`"\1"`', text)


def default_text(field: dataclasses.Field) -> str:
    value = field.default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = f'"{value}"' if isinstance(value, str) else repr(value)
    return f"`{text}`"


def table(names: list[str]) -> str:
    fields = {f.name: f for f in dataclasses.fields(TrainerOptions)}
    docs = field_docs()
    rows = ["| option | default | meaning |", "|---|---|---|"]
    rows += [f"| `{n}` | {default_text(fields[n])} | {docs[n]} |" for n in names]
    return "\n".join(rows) + "\n"


def render(page: str) -> str:
    """The page with each table region regenerated."""
    return REGION.sub(lambda m: m.group(1) + table(m.group(2).split()) + m.group(4), page)


def listed(page: str) -> list[str]:
    """Every field name the page's tables list, in page order (repeats kept)."""
    return [name for m in REGION.finditer(page) for name in m.group(2).split()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {DOC}")
    args = parser.parse_args(argv)
    page = render(DOC.read_text())
    if args.write:
        DOC.write_text(page)
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
