"""The one loader of ortrain's native libraries (``ortrain/runtime/native.py``).

- the CPU op variant follows the CPU's flags (widest supported), ``ORTRAIN_CPU_ISA``
  forces one, and one the CPU cannot run is refused in one line;
- a corrupt, foreign or wrong-version library: ``"auto"`` options fall back with a warning
  (the trainer builds and trains on standard ops), explicit ones raise one line naming the
  file; for the CPU ops and for the optimizer kernels alike, with one error class;
- the development build (no installed library): into ``$XDG_CACHE_HOME/ortrain``, only into
  a folder no other user can write, and a library that no longer matches its stored hash
  is rebuilt, never loaded;
- the baseline and the widest variant agree (1e-6) on a GPT-2's losses and gradients, and
  the kernels' own tests pass on the baseline too (the main run covers the widest).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.names import CPU_DOMAIN
from ortrain.runtime import cpu_ops, fused_update, kernels, native
from tests.conftest import gpt2, lm_batches

ROOT = Path(__file__).resolve().parents[1]
CC = next((c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c and shutil.which(c)), None)
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler to build a test library with")
WIDEST = native.supported_isas()[-1]
AVX2 = frozenset({"avx2", "fma", "f16c", "sse4_2"})
STANDARD_OPS = dict(cpu_kernels="onnxruntime", cpu_gemm="onnxruntime")  # no CPU op library
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch):
    """The CPU op library is looked up anew in the test, and again after it."""
    for name in ("ORTRAIN_CPU_ISA", "ORTRAIN_NATIVE_DIR", "ORTRAIN_KERNELS_DIR"):
        monkeypatch.delenv(name, raising=False)
    cpu_ops.cache_clear()
    yield monkeypatch
    cpu_ops.cache_clear()


@pytest.fixture
def native_dir(fresh: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An ``ORTRAIN_NATIVE_DIR`` (also the kernels' folder) the test fills."""
    folder = tmp_path / "native"
    folder.mkdir()
    fresh.setenv("ORTRAIN_NATIVE_DIR", str(folder))
    return folder


def _compile(source: str, out: Path) -> Path:
    src = out.with_suffix(".c")
    src.write_text(source)
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return out


def _one_line(exc: pytest.ExceptionInfo, path: Path) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    assert str(path) in text, text
    return text


def _tiny_gpt2(**options) -> tuple[ORTTrainer, list[dict]]:
    model = gpt2(layers=1, hidden=32, vocab=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return ORTTrainer(model, opt, TrainerOptions(**options)), lm_batches(1, 2, 8, vocab=64)


def _cpu_ops_in_graph(trainer: ORTTrainer) -> int:
    return sum(
        n
        for r in trainer.build_log
        for op, n in r.op_delta.items()
        if op.startswith(CPU_DOMAIN + "::")
    )


# --------------------------------------------------------------------------- the variant


def test_variant_follows_cpu_flags(fresh: pytest.MonkeyPatch) -> None:
    fresh.setattr(native, "_x86", lambda: True)
    for flags, isa in [(frozenset(), "baseline"), (AVX2, "avx2"), (AVX512, "avx512")]:
        fresh.setattr(native, "cpu_flags", lambda flags=flags: flags)
        assert native.cpu_isa() == isa
    fresh.setattr(native, "cpu_flags", lambda: AVX512 - {"avx512bw"})  # no full AVX-512
    assert native.cpu_isa() == "avx2"
    fresh.setattr(native, "_x86", lambda: False)  # aarch64 & co.: the portable build only
    assert native.supported_isas() == ["baseline"]


def test_variant_override(fresh: pytest.MonkeyPatch) -> None:
    fresh.setattr(native, "_x86", lambda: True)
    fresh.setattr(native, "cpu_flags", lambda: AVX2)
    fresh.setenv("ORTRAIN_CPU_ISA", "baseline")
    assert native.cpu_isa() == "baseline"
    fresh.setenv("ORTRAIN_CPU_ISA", "AVX2")
    assert native.cpu_isa() == "avx2"
    fresh.setenv("ORTRAIN_CPU_ISA", "avx512")  # it would die of an illegal instruction
    with pytest.raises(native.NativeLibraryError, match="lacks avx512bw, avx512dq, avx512f"):
        native.cpu_isa()
    fresh.setenv("ORTRAIN_CPU_ISA", "sse9")
    with pytest.raises(native.NativeLibraryError, match="use one of auto, baseline, avx2"):
        native.cpu_isa()


def test_loaded_library_is_the_selected_variant(fresh: pytest.MonkeyPatch) -> None:
    path = cpu_ops.library_path()
    assert cpu_ops.isa() == WIDEST
    assert path.name.startswith(f"libortrain_cpu_ops_{WIDEST}"), path
    if native.installed_dirs():  # an installed ortrain loads its own build, not a cache's
        assert path.parent in native.installed_dirs(), path


# --------------------------------------------------------------------------- broken libraries


def test_one_error_class() -> None:
    assert cpu_ops.CpuOpsLibraryError is native.NativeLibraryError
    assert kernels.KernelLibraryError is native.NativeLibraryError


def _assert_cpu_ops_fall_back(bad: Path, match: str, trainer: bool = False) -> None:
    """``"auto"`` warns and falls back, the explicit option raises one line naming ``bad``;
    ``trainer``: the same through ``ORTTrainer`` (which then trains on standard ops)."""
    with pytest.raises(cpu_ops.CpuOpsLibraryError) as exc:
        cpu_ops.use_grad_kernels("ortrain")
    assert match in _one_line(exc, bad)
    with pytest.raises(cpu_ops.CpuOpsLibraryError) as exc:
        cpu_ops.use_blas_gemm("blas")
    assert match in _one_line(exc, bad)
    with pytest.warns(RuntimeWarning, match="backwards run as standard ONNX ops") as warned:
        assert not cpu_ops.use_grad_kernels("auto")
    assert str(bad) in str(warned[0].message)
    if not trainer:
        return
    with pytest.raises(cpu_ops.CpuOpsLibraryError) as exc:  # at construction, not a crash
        _tiny_gpt2(cpu_kernels="ortrain", cpu_gemm="onnxruntime")
    _one_line(exc, bad)
    with pytest.warns(RuntimeWarning, match=str(bad)):
        trainer, batches = _tiny_gpt2(cpu_kernels="auto", cpu_gemm="auto")
    loss = trainer.train_step(**batches[0])
    assert torch.isfinite(loss)
    assert _cpu_ops_in_graph(trainer) == 0  # the standard-op path


def test_corrupt_cpu_library(native_dir: Path) -> None:
    bad = native_dir / cpu_ops.library_name(WIDEST)
    bad.write_bytes(b"\x7fELF but not really" * 64)
    _assert_cpu_ops_fall_back(bad, "cannot be loaded", trainer=True)


@needs_cc
def test_wrong_version_cpu_library(native_dir: Path) -> None:
    other = cpu_ops.ABI_VERSION + 1
    bad = native_dir / cpu_ops.library_name(WIDEST)
    _compile(f"int ortrain_cpu_ops_abi_version(void) {{ return {other}; }}\n", bad)
    _assert_cpu_ops_fall_back(bad, f"ABI version {other}, expected {cpu_ops.ABI_VERSION}")


@needs_cc
def test_foreign_cpu_library(native_dir: Path) -> None:
    bad = native_dir / cpu_ops.library_name(WIDEST)
    _compile("int something_else(void) { return 0; }\n", bad)
    _assert_cpu_ops_fall_back(bad, "not an ortrain library")


@pytest.mark.parametrize("kind", ["corrupt", "wrong_version"])
def test_broken_kernel_library(native_dir: Path, kind: str) -> None:
    bad = native_dir / kernels.LIBRARY_NAMES["cpu"]
    if kind == "corrupt":
        bad.write_bytes(b"not a library")
    elif CC is None:
        pytest.skip("no C compiler to build a test library with")
    else:
        _compile("int ortrain_kernels_abi_version(void) { return 999; }\n", bad)
    with pytest.raises(kernels.KernelLibraryError) as exc:
        kernels.library("cpu")
    _one_line(exc, bad)
    assert not fused_update.kernels_available(torch.device("cpu"))
    if kind != "corrupt":  # the trainer's side is the same for both
        return
    with pytest.raises(kernels.KernelLibraryError) as exc:
        _tiny_gpt2(update_engine="kernels", **STANDARD_OPS)
    _one_line(exc, bad)
    trainer, batches = _tiny_gpt2(update_engine="auto", **STANDARD_OPS)
    assert torch.isfinite(trainer.train_step(**batches[0]))


_LOAD_TRUNCATED = """
import json, warnings
from ortrain.runtime import cpu_ops, kernels
out = {}
for name, load in [("cpu_ops", lambda: cpu_ops.use_grad_kernels("ortrain")),
                   ("kernels", lambda: kernels.library("cpu"))]:
    try:
        load()
        out[name] = None
    except Exception as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
with warnings.catch_warnings(record=True) as told:
    warnings.simplefilter("always")
    out["auto"] = cpu_ops.use_grad_kernels("auto")
out["warned"] = [str(w.message) for w in told]
print(json.dumps(out))
"""


@pytest.mark.parametrize("keep", [0.5, 0.02])
def test_truncated_library_is_one_line_not_a_crash(native_dir: Path, keep: float) -> None:
    """An interrupted copy (a library cut short): loading it used to map pages past the end
    of the file and die of SIGBUS; now the ELF header's own sizes are checked first. In a
    child process: the old failure kills the process."""
    installed = native.installed_dirs()
    names = [cpu_ops.library_name(WIDEST), kernels.LIBRARY_NAMES["cpu"]]
    sources = [native.find(n, installed) for n in names]
    if None in sources:
        pytest.skip("no installed native library to cut short (a source tree)")
    bad = []
    for name, src in zip(names, sources, strict=True):
        data = src.read_bytes()  # type: ignore[union-attr]
        (native_dir / name).write_bytes(data[: int(len(data) * keep)])
        bad.append(native_dir / name)
    env = {**os.environ, "ORTRAIN_NATIVE_DIR": str(native_dir), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_TRUNCATED], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for key, path in (("cpu_ops", bad[0]), ("kernels", bad[1])):
        assert out[key] is not None and "truncated" in out[key] and str(path) in out[key], out
        assert "\n" not in out[key]
    assert out["auto"] is False and any(str(bad[0]) in w for w in out["warned"])


def test_missing_library_says_how_to_install(native_dir: Path) -> None:
    with pytest.raises(kernels.KernelLibraryError, match=r"pip install \.") as exc:
        kernels.library("cpu")
    _one_line(exc, native_dir)


# --------------------------------------------------------------------------- development build


@pytest.mark.slow
@needs_cc
def test_development_build_in_xdg_cache(fresh: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fresh.setenv("ORTRAIN_NATIVE_DIR", str(tmp_path / "nothing-installed"))
    fresh.delenv("ORTRAIN_CACHE_DIR", raising=False)
    fresh.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    fresh.setenv("ORTRAIN_CPU_ISA", "baseline")
    path = cpu_ops.library_path()
    assert path.parent == tmp_path / "xdg" / "ortrain"
    assert stat.S_IMODE(path.parent.stat().st_mode) & 0o077 == 0
    stamp = path.with_name(path.name + ".sha256")
    assert stamp.read_text().strip() == hashlib.sha256(path.read_bytes()).hexdigest()
    assert cpu_ops.isa() == "baseline"
    # a replaced library is never loaded: it no longer matches what was built, so it is rebuilt
    # (replaced, not written over: this process has the original mapped)
    other = tmp_path / "other.so"
    other.write_bytes(b"replaced")
    os.replace(other, path)
    cpu_ops.cache_clear()
    with pytest.warns(RuntimeWarning, match="does not match the hash stored when it was built"):
        assert cpu_ops.library_path() == path
    assert stamp.read_text().strip() == hashlib.sha256(path.read_bytes()).hexdigest()


@needs_cc
def test_development_build_refuses_a_shared_cache(fresh: pytest.MonkeyPatch, tmp_path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    fresh.setenv("ORTRAIN_NATIVE_DIR", str(tmp_path / "nothing-installed"))
    fresh.setenv("ORTRAIN_CACHE_DIR", str(shared))
    with pytest.raises(cpu_ops.CpuOpsLibraryError, match="other users can write it") as exc:
        cpu_ops.use_grad_kernels("ortrain")
    _one_line(exc, shared)
    with pytest.warns(RuntimeWarning, match="other users can write it"):
        assert not cpu_ops.use_grad_kernels("auto")
    assert not list(shared.iterdir())  # nothing was built there


# --------------------------------------------------------------------------- variants agree

_TRAIN = textwrap.dedent(
    """
    import json, sys
    import torch
    from ortrain import ORTTrainer, TrainerOptions
    from ortrain.runtime import cpu_ops
    from tests.conftest import gpt2, lm_batches

    torch.set_num_threads(2)
    model = gpt2(layers=2, hidden=64, vocab=128)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    options = TrainerOptions(cpu_kernels="ortrain", cpu_gemm="onnxruntime", update_engine="torch")
    trainer = ORTTrainer(model, opt, options)
    losses, grads = [], None
    for batch in lm_batches(3, batch=2, seq=16, vocab=128):
        losses.append(trainer.train_step(**batch).item())
        if grads is None:
            grads = {k: v.clone() for k, v in trainer.grads.items()}
    torch.save({"losses": losses, "grads": grads}, sys.argv[1])
    print(json.dumps({"isa": cpu_ops.isa(), "library": str(cpu_ops.library_path())}))
    """
)


def _run_variant(isa: str, out: Path) -> dict:
    env = {**os.environ, "ORTRAIN_CPU_ISA": isa, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _TRAIN, str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    info = json.loads(done.stdout.strip().splitlines()[-1])
    assert info["isa"] == isa and f"_{isa}" in Path(info["library"]).name, info
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.skipif(WIDEST == "baseline", reason="this CPU runs the baseline variant only")
def test_baseline_and_widest_variant_agree(tmp_path: Path) -> None:
    base = _run_variant("baseline", tmp_path / "baseline.pt")
    wide = _run_variant(WIDEST, tmp_path / f"{WIDEST}.pt")
    torch.testing.assert_close(
        torch.tensor(wide["losses"]), torch.tensor(base["losses"]), rtol=1e-6, atol=0
    )
    assert wide["grads"].keys() == base["grads"].keys() and len(base["grads"]) >= 10
    scale = max(g.abs().max().item() for g in base["grads"].values())
    for name, g in base["grads"].items():
        torch.testing.assert_close(wide["grads"][name], g, rtol=1e-6, atol=1e-6 * scale)


KERNEL_TESTS = [
    "tests/test_grad_kernels.py",
    "tests/test_forward_kernels.py",
    "tests/test_elementwise_kernels.py",
    "tests/test_layout_kernels.py",
    "tests/test_cpu_softmax.py",
    "tests/test_blas_gemm.py",
    "tests/test_blas_batch_matmul.py",
    "tests/test_kernel_threads.py",
]


@pytest.mark.slow
@pytest.mark.skipif(WIDEST == "baseline", reason="the main run already runs the baseline")
def test_kernel_tests_pass_on_the_baseline_variant() -> None:
    """The kernels' own op-level tests (against numpy / torch in float64, thread-count
    independence, errors) in a process that loads the baseline variant; this run loads the
    widest. The model-training ones are left out here: the GPT-2 comparison above covers
    the variants end to end."""
    env = {**os.environ, "ORTRAIN_CPU_ISA": "baseline"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS]
    cmd += ["-k", "not train and not choice and not gpt2"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
