"""The ``ortrain.blas`` custom-op library: compiled on first use, handed torch's sgemm.

``blas_gemm.c`` (beside this file) is compiled with the system C compiler into
``$ORTRAIN_CACHE_DIR`` (default ``~/.cache/ortrain``), once per source and compiler
(the file name carries a hash of both), the way torch's C++ extensions build on first
use. The sgemm it calls is the Fortran-interface ``sgemm_`` that torch's CPU library
exports (MKL in x86 wheels): no second BLAS is loaded, and the products run on the
same OpenMP threads, at the same rates, as eager torch's.

``use_blas_gemm(choice)`` resolves ``TrainerOptions.cpu_gemm``: "auto" takes the library
on Intel CPUs when torch was built with MKL (on AMD EPYC, MLAS measured faster than
MKL: DESIGN.md), "blas" takes it wherever it can be built (and fails with the reason
otherwise), "onnxruntime" never.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from ortrain.errors import OrtrainError

SOURCE = Path(__file__).resolve().parent / "blas_gemm.c"
ABI_VERSION = 1  # blas_gemm.c: ortrain_blas_abi_version
CHOICES = ("auto", "blas", "onnxruntime")


class BlasLibraryError(OrtrainError):
    """The ``ortrain.blas`` library cannot be built or has no sgemm to call."""


def cache_dir() -> Path:
    return Path(os.environ.get("ORTRAIN_CACHE_DIR") or Path.home() / ".cache" / "ortrain")


def _compiler() -> str:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    raise BlasLibraryError("no C compiler (cc, gcc or clang on PATH, or $CC) to build it with")


def _torch_sgemm() -> int:
    """The address of torch's exported ``sgemm_``."""
    lib_dir = Path(torch.__file__).resolve().parent / "lib"
    errors = []
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        path = lib_dir / name
        if not path.is_file():
            continue
        try:
            address = ctypes.cast(ctypes.CDLL(str(path)).sgemm_, ctypes.c_void_p).value
        except (OSError, AttributeError) as exc:
            errors.append(f"{path}: {exc}")
            continue
        if address:
            return address
        errors.append(f"{path}: sgemm_ resolves to a null address")
    raise BlasLibraryError(
        f"torch's CPU library exports no sgemm_ ({'; '.join(errors) or f'none in {lib_dir}'})"
    )


@functools.cache
def library_path() -> Path:
    """The built library, ready for ``register_custom_ops_library`` (built and handed
    torch's sgemm once per process). Raises ``BlasLibraryError`` with the reason."""
    cc = _compiler()
    sgemm = _torch_sgemm()
    key = hashlib.sha256(SOURCE.read_bytes() + cc.encode()).hexdigest()[:16]
    path = cache_dir() / f"libortrain_blas-{key}.so"
    if not path.is_file():
        try:
            _compile(cc, path)
        except OSError as exc:  # an unwritable cache folder, a compiler that cannot run
            raise BlasLibraryError(f"cannot build {path}: {exc}") from None
    lib = ctypes.CDLL(str(path))
    if lib.ortrain_blas_abi_version() != ABI_VERSION:
        raise BlasLibraryError(
            f"{path} has ABI {lib.ortrain_blas_abi_version()}, not {ABI_VERSION}"
        )
    lib.ortrain_blas_set_sgemm.argtypes = [ctypes.c_void_p]
    if lib.ortrain_blas_set_sgemm(sgemm) != 0:
        raise BlasLibraryError(f"{path} refused the sgemm address {sgemm:#x}")
    return path


def _compile(cc: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        cmd = [cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(SOURCE)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise BlasLibraryError(f"`{' '.join(cmd)}` failed: {last}")
        os.replace(out, path)  # atomic: a concurrent build leaves one whole file


def _intel_cpu() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("vendor_id") and "GenuineIntel" in line for line in f)
    except OSError:
        return False


def use_blas_gemm(choice: str, device_type: str = "cpu") -> bool:
    """Whether CPU graphs should run their fp32 products on ``ortrain.blas.Gemm``."""
    if choice not in CHOICES:
        raise ValueError(f"cpu_gemm={choice!r}: use one of {', '.join(CHOICES)}")
    if choice == "onnxruntime" or device_type != "cpu":
        return False
    if choice == "auto" and not (_intel_cpu() and torch.backends.mkl.is_available()):
        return False
    try:
        library_path()
    except BlasLibraryError as exc:
        if choice == "blas":
            raise BlasLibraryError(f"cpu_gemm='blas': {exc}") from None
        warnings.warn(
            f"ortrain: the BLAS GEMM op is unavailable ({exc}); products run on ONNX "
            "Runtime's MLAS (set cpu_gemm='onnxruntime' to silence this)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True
