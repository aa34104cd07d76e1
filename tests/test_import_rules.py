"""The import rules of the layout (docs/architecture.md): the compiler (graph_passes) sees
only the shared types in ``ortrain.core``; no cycles among the project's modules; the CLI
reaches the recipes by plain imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# where each package's source lives in the repository (graph_passes/ and recipes/ are
# linked into ortrain/ and installed there)
SOURCES = {"ortrain": ROOT / "ortrain", "ortrain.graph_passes": ROOT / "graph_passes",
           "ortrain.recipes": ROOT / "recipes"}  # fmt: skip
pytestmark = pytest.mark.unit


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if package == "ortrain" and parts[:1] in (["graph_passes"], ["recipes"]):
                continue  # the links
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, types: bool = False) -> set[str]:
    """Project modules ``name`` imports anywhere in its code (functions included): a lazy
    import inside a function still makes a dependency; ``types``: type checking blocks
    too."""
    tree = ast.parse(path.read_text(), str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if not types and isinstance(node, ast.If) and _is_type_checking(node):
            skip |= {id(n) for n in ast.walk(node)}
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]  # fmt: skip
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
            # importing a.b.c runs a.b's __init__ first: a dependency unless name is in a.b
            parent = target.rpartition(".")[0]
            while parent and parent != name and not name.startswith(parent + "."):
                if parent in MODULES and is_package_of(parent):
                    out.add(parent)
                parent = parent.rpartition(".")[0]
    return out


def is_package_of(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}
# with the imports made for type annotations only
TYPED = {name: _imports(name, path, types=True) for name, path in MODULES.items()}


def test_the_layout_is_found() -> None:
    assert "ortrain.graph_passes.training_pipeline" in MODULES
    assert "ortrain.core.roles" in MODULES and "ortrain.recipes.gpt2_pretrain" in MODULES
    assert "ortrain.graph_passes.infra.pipeline" in GRAPH["ortrain.graph_passes.training_pipeline"]


def test_the_compiler_imports_only_the_shared_types() -> None:
    allowed = ("ortrain.graph_passes", "ortrain.core")
    bad = {
        name: sorted(t for t in targets if not t.startswith(allowed))
        for name, targets in GRAPH.items()
        if name.startswith("ortrain.graph_passes")
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_shared_types_import_nothing_above_them() -> None:
    bad = {
        name: sorted(t for t in targets if not t.startswith("ortrain.core"))
        for name, targets in GRAPH.items()
        if name.startswith("ortrain.core")
    }
    assert {k: v for k, v in bad.items() if v} == {}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    assert _cycles(GRAPH) == []


def test_no_import_cycles_through_type_annotations_either() -> None:
    # a layer that names an upper one's type depends on it as much as by a call: the
    # engines, reducers and checkpoints take the training state, never the trainer
    assert _cycles(TYPED) == []
    facade = ("ortrain.trainer", "ortrain.trainer_state", "ortrain.trainer_views")  # its bases
    below = {n for f in facade for n in TYPED[f] if not n.startswith("ortrain.graph_passes")}
    below -= set(facade)
    assert "ortrain.checkpoint" in below and "ortrain.distributed" in below
    assert [n for n in below if any(f in TYPED[n] for f in facade)] == []


def test_the_cycle_finder_finds_one() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_cli_imports_the_recipes_plainly() -> None:
    source = MODULES["ortrain.cli"].read_text()
    assert "importlib" not in source and "__import__" not in source
    assert "ortrain.recipes.gpt2_pretrain" in GRAPH["ortrain.cli"]


def test_nothing_imports_the_top_level_folders() -> None:
    # graph_passes/ and recipes/ are importable from a checkout's root too; a module
    # imported under both names would be two modules with two sets of globals
    others = [p for d in ("tests", "benchmarks", "examples") for p in (ROOT / d).rglob("*.py")]
    for path in [*MODULES.values(), *others]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            for n in names:
                assert n.split(".")[0] not in ("graph_passes", "recipes"), (path, n)
