"""``warm_builds`` (ortrain/build_warmup.py): what a first build makes is made in this
process, and nothing else it touches changes: the build-in-process switch, the RNG, the
graph cache."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ortrain.build_warmup import warm_builds
from ortrain.forked import IN_PROCESS_ENV


@pytest.mark.parametrize("before", [None, "0"])
def test_leaves_the_switch_the_rng_and_the_cache_as_they_were(before, tmp_path, monkeypatch):
    if before is None:
        monkeypatch.delenv(IN_PROCESS_ENV, raising=False)
    else:
        monkeypatch.setenv(IN_PROCESS_ENV, before)
    monkeypatch.setenv("ORTRAIN_GRAPH_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(123)
    want = torch.rand(4)
    torch.manual_seed(123)
    warm_builds()
    assert torch.equal(torch.rand(4), want)
    assert os.environ.get(IN_PROCESS_ENV) == before
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*"))


@pytest.mark.slow
def test_a_fresh_process_ends_with_the_first_export_s_modules_frozen():
    # in a fresh process: this one was warmed before its first test (tests/conftest.py)
    code = (
        "import sys\n"
        "from ortrain.build_warmup import warm_builds\n"
        "names = ('torch.onnx._internal.exporter._core', 'torch.export._trace', "
        "'ortrain.graph_passes.training_pipeline')\n"
        "import gc\n"
        "print([n in sys.modules for n in names])\n"
        "warm_builds()\n"
        "print([n in sys.modules for n in names])\n"
        "print(gc.get_freeze_count() > len(gc.get_objects()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    ).stdout.split("\n")
    assert out[:2] == ["[False, False, False]", "[True, True, True]"], out
    # what the warm-up left is frozen: later full collections do not walk it again
    assert out[2] == "True", out
