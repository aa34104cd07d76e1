"""Packaging: what a fresh machine gets from ``pyproject.toml`` and ``CMakeLists.txt``.

- every third-party module the tests (and the package) import is declared: the tests'
  in the extras the README installs (``dev``, ``recipes``), so ``.ci/run``'s brand-new
  virtual environment has it;
- the CUDA part of the CMake project is skipped with one clear line where no toolkit is
  found, and is an error where it was asked for;
- ``pip wheel . --no-deps`` builds a wheel that carries every native library; installed
  into a new virtual environment whose PATH has no C compiler, it trains a tiny GPT-2 with
  the ``ortrain.cpu`` kernels in the graph, with the losses of the standard-op path.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest
import tomllib

from ortrain.runtime import cpu_ops, kernels, native

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
README_EXTRAS = ("dev", "recipes")  # scripts/setup.sh: pip install -e ".[dev,recipes]"
COMPILERS = ("cc", "gcc", "clang", "c++", "g++", "clang++")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(requirements: list[str]) -> set[str]:
    return {_canonical(re.split(r"[\s<>=!~;\[(]", r, maxsplit=1)[0]) for r in requirements}


def _imports(folder: Path) -> dict[str, Path]:
    """Top-level modules imported anywhere under ``folder`` (also inside functions and
    ``pytest.importorskip``), each with one file that imports it."""
    found: dict[str, Path] = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", None) == "importorskip"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                names = [str(node.args[0].value)]
            for name in names:
                found.setdefault(name.partition(".")[0], path)
    return found


def _third_party(imports: dict[str, Path], folder: Path) -> dict[str, Path]:
    local = {p.name for p in ROOT.iterdir() if p.is_dir()} | {p.stem for p in folder.glob("*.py")}
    skip = set(sys.stdlib_module_names) | local | {"__future__"}
    return {m: p for m, p in imports.items() if m not in skip}


def _undeclared(folder: str, declared: set[str]) -> list[str]:
    distributions = md.packages_distributions()
    missing = []
    for module, path in sorted(_third_party(_imports(ROOT / folder), ROOT / folder).items()):
        dists = {_canonical(d) for d in distributions.get(module, [])}
        if not dists & declared:
            where = ", ".join(sorted(dists)) or "not installed"
            missing.append(f"{module} ({where}; imported by {path.relative_to(ROOT)})")
    return missing


def test_test_dependencies_are_declared() -> None:
    """What ``.ci/run``'s new environment installs covers every import of the tests."""
    project = PYPROJECT["project"]
    extras = project["optional-dependencies"]
    declared = _requirement_names(project["dependencies"])
    for extra in README_EXTRAS:
        declared |= _requirement_names(extras[extra])
    assert {"scipy", "hypothesis", "pytest"} <= declared
    missing = _undeclared("tests", declared)
    assert not missing, f"declare in pyproject.toml's {README_EXTRAS} extras: {missing}"


@pytest.mark.parametrize("package", ["ortrain", "graph_passes", "recipes"])
def test_package_dependencies_are_declared(package: str) -> None:
    project = PYPROJECT["project"]
    declared = _requirement_names(project["dependencies"])
    for requirements in project["optional-dependencies"].values():
        declared |= _requirement_names(requirements)
    missing = _undeclared(package, declared)
    assert not missing, f"declare in pyproject.toml: {missing}"


def test_ci_runs_the_readme_command_in_a_new_venv() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```bash", 1)[1].split("```", 1)[0]
    assert "bash scripts/setup.sh" in first_block and "bash scripts/test.sh" in first_block
    assert "-m venv" in ci and "mktemp -d" in ci and "rm -rf" in ci
    assert "bash scripts/test.sh" in ci
    assert "pip install" not in ci  # installs only through the README's commands


# --------------------------------------------------------------------------- CMake


def _configure(tmp_path: Path, *flags: str, env: dict | None = None):
    if shutil.which("cmake") is None:
        pytest.skip("cmake not found")
    cmd = ["cmake", "-S", str(ROOT), "-B", str(tmp_path / "build"), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})


def test_cuda_part_skipped_in_one_line_without_a_toolkit(tmp_path: Path) -> None:
    no_toolkit = {"CUDACXX": "/nonexistent/nvcc"}
    done = _configure(tmp_path, env=no_toolkit)
    assert done.returncode == 0, done.stderr
    skipped = [ln for ln in done.stdout.splitlines() if "libortrain_kernels_cuda" in ln]
    assert len(skipped) == 1 and "no CUDA toolkit found" in skipped[0], done.stdout
    variants = re.search(r"ortrain: CPU op variants: (\S+)", done.stdout)
    assert variants and variants[1].split(";")[0] == "baseline", done.stdout
    asked = _configure(tmp_path / "on", "-DORTRAIN_KERNELS_CUDA=ON", env=no_toolkit)
    assert asked.returncode != 0
    assert "ORTRAIN_KERNELS_CUDA=ON but no CUDA toolkit was found" in asked.stderr


# --------------------------------------------------------------------------- the wheel

_CHILD = textwrap.dedent(
    """
    import copy, json, os, shutil, sys

    import torch

    on_path = [c for c in sys.argv[1].split(",") if shutil.which(c)]
    assert not on_path, f"compilers on PATH: {on_path}"
    import ortrain
    from ortrain.core.names import CPU_DOMAIN
    from ortrain import ORTTrainer, TrainerOptions
    from ortrain.runtime import cpu_ops
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
    )
    ref = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        batches.append({"input_ids": ids, "labels": ids})


    def train(cpu_kernels):
        model = copy.deepcopy(ref)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        options = TrainerOptions(cpu_kernels=cpu_kernels, update_engine="torch")
        trainer = ORTTrainer(model, opt, options)
        losses = [trainer.train_step(**b).item() for b in batches]
        ops = {}
        for r in trainer.build_log:
            for op, n in r.op_delta.items():
                if r.graph == "train" and op.startswith(CPU_DOMAIN + "::"):
                    ops[op] = ops.get(op, 0) + n
        return losses, ops


    fused, fused_ops = train("ortrain")
    standard, standard_ops = train("onnxruntime")
    print(json.dumps({
        "ortrain": ortrain.__file__, "library": str(cpu_ops.library_path()),
        "isa": cpu_ops.isa(), "fused": fused, "standard": standard,
        "fused_ops": fused_ops, "standard_ops": standard_ops,
    }))
    """
)


def _build_wheel(tmp_path: Path) -> Path:
    """``pip wheel . --no-deps``, in a build folder of its own; the CUDA part off (the
    editable install and tests/test_cuda_kernels.py compile it)."""
    dist = tmp_path / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-w", str(dist)]
    cmd += ["-q", "--disable-pip-version-check", "-C", f"build-dir={tmp_path / 'build'}"]
    done = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, "ORTRAIN_CUDA": "OFF"}
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (wheel,) = dist.glob("ortrain-*.whl")
    return wheel


def _venv_without_compiler(tmp_path: Path, wheel: Path) -> Path:
    """A new venv with the wheel installed; its other requirements are this environment's,
    read from a path entry (no second download of torch; this environment's own .pth hooks,
    an editable ortrain's among them, are not run)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)]
    subprocess.run([*install, "--disable-pip-version-check"], check=True)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    outer = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (Path(site) / "outer_requirements.pth").write_text("".join(f"{p}\n" for p in outer))
    return python


@pytest.mark.slow
def test_wheel_trains_without_a_compiler(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    assert wheel.name.endswith("-py3-none-linux_x86_64.whl") or "py3-none" in wheel.name
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = [cpu_ops.library_name(isa) for isa in native.supported_isas()]
    wanted.append(kernels.LIBRARY_NAMES["cpu"])
    for lib in wanted:
        assert f"ortrain/_native/{lib}" in names, sorted(n for n in names if "_native" in n)
    # graph_passes/ and recipes/ install inside ortrain (linked there in a checkout)
    assert "ortrain/graph_passes/__init__.py" in names and "ortrain/recipes/__init__.py" in names
    assert "ortrain/graph_passes/targets/cpu/softmax.py" in names
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"ortrain"}, tops

    python = _venv_without_compiler(tmp_path, wheel)
    home, cache = tmp_path / "home", tmp_path / "cache"
    home.mkdir()
    env = {"PATH": str(python.parent), "HOME": str(home), "ORTRAIN_CACHE_DIR": str(cache)}
    env["LANG"] = "C.UTF-8"
    done = subprocess.run(
        [str(python), "-c", _CHILD, ",".join(COMPILERS)],
        cwd=home,  # not the repository: its ortrain/ must not be imported
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    installed = python.parent.parent
    assert Path(result["ortrain"]).is_relative_to(installed), result["ortrain"]
    library = Path(result["library"])
    assert library.is_relative_to(installed) and library.parent.name == "_native", library
    assert result["isa"] == native.supported_isas()[-1]
    assert not cache.exists()  # nothing compiled: the wheel's own library ran
    for op in ("LayerNormGrad", "SoftmaxGrad", "FastGeluGrad"):
        assert result["fused_ops"].get(f"ortrain.cpu::{op}", 0) >= 2, result["fused_ops"]
    assert not result["standard_ops"]
    assert len(result["fused"]) == len(result["standard"]) == 3
    for fused, standard in zip(result["fused"], result["standard"]):
        assert abs(fused - standard) <= 1e-5 * max(1.0, abs(standard)), result
