"""The test kinds and the fast lane: every collected test has exactly one of unit/e2e/gpu
(tests/conftest.py sets them), ``slow`` and ``e2e`` mark the same tests, each module keeps a
quick test in the fast lane (``-m "not slow"``), and a misspelt marker fails collection.

The run's own collection is used where it is the whole suite (tests/conftest.py keeps each
test's markers from before ``-m`` / ``-k`` deselect any); otherwise the suite is collected
in a subprocess (collection only, nothing runs), with a small plugin that writes each
test's id and marker names to a JSON file.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import KINDS

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]

# Modules with no quick test at all: every test in them trains a model end to end.
ALL_SLOW = {"test_model_families.py"}  # one HF model per family, each trained like eager

_COLLECT = """
import json, sys

import pytest


class Dump:
    def pytest_collection_finish(self, session):
        rows = [[i.nodeid, [m.name for m in i.iter_markers()]] for i in session.items]
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f)


sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"], [Dump()]))
"""


def _whole_suite(seen: dict[str, set[str]]) -> bool:
    """Whether ``seen`` holds a test of every test module (the run collected ``tests``)."""
    modules = {n.split("::")[0] for n in seen}
    return all(f"tests/{f.name}" in modules for f in (ROOT / "tests").glob("test_*.py"))


@pytest.fixture(scope="module")
def collected(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, set[str]]:
    """Test id -> the names of its markers, for the whole suite: what this run collected
    where it collected the whole suite (conftest.py keeps it), else a collection of its
    own."""
    seen = getattr(request.config, "ortrain_collected", {})
    if _whole_suite(seen):
        return seen
    out = tmp_path_factory.mktemp("collect") / "items.json"
    done = subprocess.run(
        [sys.executable, "-c", _COLLECT, str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"collection failed:\n{done.stdout[-4000:]}\n{done.stderr}"
    rows = json.loads(out.read_text())
    assert len(rows) > 100, rows  # the whole suite, not one module
    return {nodeid: set(names) for nodeid, names in rows}


def test_every_test_has_exactly_one_kind(collected: dict[str, set[str]]) -> None:
    wrong = {n: sorted(m & set(KINDS)) for n, m in collected.items() if len(m & set(KINDS)) != 1}
    assert not wrong, f"tests without exactly one of {KINDS}: {wrong}"
    for kind in KINDS:  # the rules in conftest.py find each kind somewhere
        assert any(kind in m for m in collected.values()), kind


def test_slow_and_e2e_mark_the_same_tests(collected: dict[str, set[str]]) -> None:
    wrong = sorted(n for n, m in collected.items() if ("slow" in m) != ("e2e" in m))
    assert not wrong, f"slow without e2e or e2e without slow: {wrong}"


def test_each_module_keeps_a_quick_test_in_the_fast_lane(collected: dict[str, set[str]]) -> None:
    quick: dict[str, int] = defaultdict(int)
    for nodeid, marks in collected.items():
        quick[nodeid.split("::")[0]] += "slow" not in marks
    all_slow = {Path(module).name for module, n in quick.items() if n == 0}
    assert all_slow == ALL_SLOW, (
        "a module with no quick test left: keep a quick one out of `slow` "
        "(or list the module in ALL_SLOW if it has nothing quick)"
    )


def test_cuda_modules_are_gpu_or_e2e(collected: dict[str, set[str]]) -> None:
    cuda = {
        n: m for n, m in collected.items() if Path(n.split("::")[0]).name.startswith("test_cuda_")
    }
    assert cuda
    assert all(("gpu" in m) != ("e2e" in m) for m in cuda.values())


def test_a_misspelt_marker_fails_collection(tmp_path: Path) -> None:
    test = tmp_path / "test_typo.py"
    test.write_text(
        textwrap.dedent("""
            import pytest

            @pytest.mark.slwo
            def test_x():
                pass
        """)
    )
    # The project's configuration, on a file outside it: nothing else of the suite loads.
    config = ("-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path))
    collect = (sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider")
    done = subprocess.run(
        [*collect, *config, str(test)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "'slwo' not found in `markers`" in done.stdout + done.stderr
