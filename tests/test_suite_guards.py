"""The suite's own guards (tests/conftest.py), each on a tiny suite run in a subprocess with
a copy of the project's conftest: the per-test time budget fails a test that spends more CPU
time than it allows (its children's included), and under pytest-xdist the tests that share
a module fixture run on one worker, which builds the fixture once."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_SUITE = """
import os, subprocess, sys, time

import pytest


def _burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_quick():
    pass


def test_burns_cpu_here():
    _burn(1.5)


def test_burns_cpu_in_a_child():
    subprocess.run([sys.executable, "-c", "import time\\nend = time.process_time() + 1.5\\n"
                    "while time.process_time() < end: pass"], check=True)


@pytest.fixture(scope="module")
def built():
    with open(os.environ["BUILT_LOG"], "a") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "main") + "\\n")


@pytest.mark.parametrize("i", range(6))
def test_shares_the_fixture(built, i):
    with open(os.environ["RAN_LOG"], "a") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "main") + "\\n")
"""


def _suite(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    tests = tmp_path / "tests"
    tests.mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", tests / "conftest.py")
    (tests / "test_tiny.py").write_text(textwrap.dedent(_SUITE))
    config = ("-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path))
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *config, "tests", *args]
    for name in ("BUILT_LOG", "RAN_LOG"):
        env[name] = str(tmp_path / name)
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    return subprocess.run(
        cmd, cwd=tmp_path, env={**run_env, **env}, capture_output=True, text=True, timeout=600
    )


def test_a_test_over_its_cpu_budget_fails(tmp_path: Path) -> None:
    done = _suite(tmp_path, "-q", "-k", "quick or burns", ORTRAIN_TEST_BUDGET_S="1")
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "2 failed, 1 passed" in out, out
    for name in ("test_burns_cpu_here", "test_burns_cpu_in_a_child"):
        assert f"FAILED tests/test_tiny.py::{name}" in out, out
    assert "over the budget of 1 s of CPU time" in out, out
    assert "most CPU time per test (budget 1 s CPU, 4 s wall)" in out, out


def test_the_budget_can_be_turned_off(tmp_path: Path) -> None:
    done = _suite(tmp_path, "-q", "-k", "burns_cpu_here", ORTRAIN_TEST_BUDGET_S="0")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
def test_tests_sharing_a_module_fixture_run_on_one_worker(tmp_path: Path) -> None:
    done = _suite(tmp_path, "-q", "-n", "2", "--dist", "loadgroup", "-k", "shares or quick")
    assert done.returncode == 0, done.stdout + done.stderr
    built = (tmp_path / "BUILT_LOG").read_text().split()
    ran = (tmp_path / "RAN_LOG").read_text().split()
    assert len(built) == 1 and built[0].startswith("gw"), built
    assert ran == built * 6, ran
