"""ortrain's CPU custom-op library: compiled on first use, registered on CPU sessions.

One shared library from the C files beside this module (``ort_abi.h`` declares the ONNX
Runtime ABI they use), with two op domains:

- ``ortrain.cpu``: fused fp32 backward kernels (``grad_kernels.c``: GeluGrad,
  FastGeluGrad, SoftmaxGrad, LayerNormGrad) that the gradient rules emit for CPU builds
  (``use_grad_kernels``, ``TrainerOptions.cpu_kernels``);
- ``ortrain.blas``: ``Gemm`` on the BLAS sgemm torch's CPU library exports (MKL in x86
  wheels; ``blas_gemm.c``): no second BLAS is loaded, and the products run on the same
  OpenMP threads, at the same rates, as eager torch's. Registered only once torch's
  ``sgemm_`` was handed over (``blas_library_path``).

The library is compiled with the system C compiler (``-O3 -march=native``, or ``-O3`` if
the compiler refuses that) into ``$ORTRAIN_CACHE_DIR`` (default ``~/.cache/ortrain``),
once per source, compiler and CPU (the file name carries a hash of all three), the way
torch's C++ extensions build on first use.

``use_blas_gemm(choice)`` resolves ``TrainerOptions.cpu_gemm``: "auto" takes the BLAS op
on Intel CPUs when torch was built with MKL (on AMD EPYC, MLAS measured faster than
MKL: DESIGN.md), "blas" takes it wherever it can be built (and fails with the reason
otherwise), "onnxruntime" never.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from ortrain.errors import OrtrainError

_HERE = Path(__file__).resolve().parent
SOURCES = tuple(
    _HERE / n
    for n in (
        "cpu_ops.c",
        "grad_kernels.c",
        "forward_kernels.c",
        "layout_kernels.c",
        "elementwise_kernels.c",
        "update_kernels.c",
        "softmax.c",
        "blas_gemm.c",
        "blas_batch.c",
    )
)
HEADERS = (_HERE / "ort_abi.h", _HERE / "kernel_util.h")
ABI_VERSION = 4  # cpu_ops.c: ortrain_cpu_ops_abi_version
CHOICES = ("auto", "blas", "onnxruntime")
KERNEL_CHOICES = ("auto", "ortrain", "onnxruntime")


class CpuOpsLibraryError(OrtrainError):
    """ortrain's CPU custom-op library cannot be built, or has no sgemm to call."""


def cache_dir() -> Path:
    return Path(os.environ.get("ORTRAIN_CACHE_DIR") or Path.home() / ".cache" / "ortrain")


def _compiler() -> str:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    raise CpuOpsLibraryError("no C compiler (cc, gcc or clang on PATH, or $CC) to build it with")


def _torch_sgemm() -> int:
    """The address of torch's exported ``sgemm_``."""
    return _torch_blas()[0]


def _torch_blas() -> tuple[int, int | None]:
    """The addresses of torch's exported ``sgemm_`` and (MKL only) ``sgemm_batch_``."""
    lib_dir = Path(torch.__file__).resolve().parent / "lib"
    errors = []
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        path = lib_dir / name
        if not path.is_file():
            continue
        try:
            lib = ctypes.CDLL(str(path))
            address = ctypes.cast(lib.sgemm_, ctypes.c_void_p).value
        except (OSError, AttributeError) as exc:
            errors.append(f"{path}: {exc}")
            continue
        if address:
            batch = getattr(lib, "sgemm_batch_", None)
            return address, ctypes.cast(batch, ctypes.c_void_p).value if batch else None
        errors.append(f"{path}: sgemm_ resolves to a null address")
    raise CpuOpsLibraryError(
        f"torch's CPU library exports no sgemm_ ({'; '.join(errors) or f'none in {lib_dir}'})"
    )


def _cpu_identity() -> bytes:
    """What ``-march=native`` compiles for: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            keep = ("model name", "flags", "Features", "CPU part")
            return "".join(sorted({ln for ln in f if ln.startswith(keep)})).encode()
    except OSError:
        return platform.machine().encode() + platform.processor().encode()


@functools.cache
def _library() -> tuple[Path, ctypes.CDLL]:
    cc = _compiler()
    flags = _native_flags() + _openmp_flags()
    digest = hashlib.sha256(cc.encode() + " ".join(flags).encode() + _cpu_identity())
    for f in SOURCES + HEADERS:
        digest.update(f.read_bytes())
    path = cache_dir() / f"libortrain_cpu_ops-{digest.hexdigest()[:16]}.so"
    if not path.is_file():
        try:
            _compile(cc, path)
        except OSError as exc:  # an unwritable cache folder, a compiler that cannot run
            raise CpuOpsLibraryError(f"cannot build {path}: {exc}") from None
    lib = ctypes.CDLL(str(path))
    if lib.ortrain_cpu_ops_abi_version() != ABI_VERSION:
        raise CpuOpsLibraryError(
            f"{path} has ABI {lib.ortrain_cpu_ops_abi_version()}, not {ABI_VERSION}"
        )
    lib.ortrain_use_omp_team(int(_same_openmp(lib)))
    return path, lib


def _torch_openmp_symbol() -> int | None:
    """The address of the ``omp_get_max_threads`` torch's CPU library calls, or None."""
    lib_dir = Path(torch.__file__).resolve().parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        try:
            lib = ctypes.CDLL(str(lib_dir / name))
            return ctypes.cast(lib.omp_get_max_threads, ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
    return None


def _same_openmp(lib: ctypes.CDLL) -> bool:
    """Whether the library was built with OpenMP and binds the runtime torch binds: then its
    kernels share torch's (and so the BLAS products') thread team. A second runtime would
    bring a second team of threads competing for the same cores, so the kernels then stay
    on ONNX Runtime's threads."""
    lib.ortrain_omp_symbol.restype = ctypes.c_void_p
    ours = lib.ortrain_omp_symbol()
    return ours is not None and ours == _torch_openmp_symbol()


def omp_team() -> bool:
    """Whether the built library runs its kernels on torch's OpenMP team."""
    return bool(ctypes.c_int.in_dll(_library()[1], "ortrain_omp_team").value)


def library_path() -> Path:
    """The built library, ready for ``register_custom_ops_library`` (built once per
    process). Raises ``CpuOpsLibraryError`` with the reason."""
    return _library()[0]


@functools.cache
def blas_library_path() -> Path:
    """``library_path()``, with torch's sgemm (and MKL's sgemm_batch) handed over so that
    the library registers ``ortrain.blas.Gemm`` and ``BatchMatMul`` too."""
    sgemm, batch = _torch_blas()
    path, lib = _library()
    lib.ortrain_blas_set_sgemm.argtypes = [ctypes.c_void_p]
    if lib.ortrain_blas_set_sgemm(sgemm) != 0:
        raise CpuOpsLibraryError(f"{path} refused the sgemm address {sgemm:#x}")
    lib.ortrain_blas_set_sgemm_batch.argtypes = [ctypes.c_void_p]
    lib.ortrain_blas_set_sgemm_batch(batch)  # None: one sgemm per matrix
    return path


def cache_clear() -> None:
    """Forget the built library (tests: a changed cache folder or compiler)."""
    _library.cache_clear()
    blas_library_path.cache_clear()


def _native_flags() -> list[str]:
    """-march=native: the kernels' loops vectorize for this CPU's widest units (on x86,
    512-bit ones where it has them: GCC prefers 256); -fopenmp-simd: the `omp simd`
    pragmas. Without them, the build falls back to plain -O3."""
    flags = ["-march=native", "-fopenmp-simd"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags.append("-mprefer-vector-width=512")
    return flags


def _openmp_flags() -> list[str]:
    """-fopenmp where torch runs on GNU OpenMP (its wheel ships ``libgomp.so.1``, which the
    library's own ``libgomp.so.1`` then resolves to once torch is loaded): the kernels
    share torch's thread team (``_same_openmp`` checks at load time)."""
    lib_dir = Path(torch.__file__).resolve().parent / "lib"
    return ["-fopenmp"] if any(lib_dir.glob("libgomp*.so*")) else []


def _compile(cc: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        # no errno from sqrtf & co.: a loop calling them vectorizes (the kernels never read it)
        base = [cc, "-O3", "-fno-math-errno", "-shared", "-fPIC", "-o", str(out)]
        base += [*map(str, SOURCES), "-lm"]
        native, openmp = _native_flags(), _openmp_flags()
        # the fullest build the compiler accepts: a missing OpenMP runtime or an unknown
        # -march drops those flags, not the library
        tries = [[*native, *openmp], native, []] if openmp else [native, []]
        for extra in tries:
            done = subprocess.run([*base[:2], *extra, *base[2:]], capture_output=True, text=True)
            if done.returncode == 0:
                break
        else:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise CpuOpsLibraryError(f"`{' '.join(base)}` failed: {last}")
        os.replace(out, path)  # atomic: a concurrent build leaves one whole file


def _intel_cpu() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("vendor_id") and "GenuineIntel" in line for line in f)
    except OSError:
        return False


def _built_or_fallback(build: Callable[[], Path], strict: bool, option: str, fallback: str) -> bool:
    """Build the library for ``option``: True, or (the library cannot be built) raise with
    the reason when ``strict`` (the option named it), else warn and return False."""
    try:
        build()
    except CpuOpsLibraryError as exc:
        if strict:
            raise CpuOpsLibraryError(f"{option}: {exc}") from None
        name = option.partition("=")[0]
        warnings.warn(
            f"ortrain: {fallback[0]} ({exc}); {fallback[1]} (set {name}='onnxruntime' to "
            "silence this)",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    return True


def use_blas_gemm(choice: str, device_type: str = "cpu") -> bool:
    """Whether CPU graphs should run their fp32 products on ``ortrain.blas.Gemm``."""
    if choice not in CHOICES:
        raise ValueError(f"cpu_gemm={choice!r}: use one of {', '.join(CHOICES)}")
    if choice == "onnxruntime" or device_type != "cpu":
        return False
    if choice == "auto" and not (_intel_cpu() and torch.backends.mkl.is_available()):
        return False
    return _built_or_fallback(
        blas_library_path, choice == "blas", "cpu_gemm='blas'",
        ("the BLAS GEMM op is unavailable", "products run on ONNX Runtime's MLAS"),
    )  # fmt: skip


def has_sgemm_batch() -> bool:
    """Whether torch's BLAS has MKL's ``sgemm_batch`` (``ortrain.blas.BatchMatMul`` pays
    only with it: graph_passes/blas_batch_matmul.py)."""
    try:
        return _torch_blas()[1] is not None
    except CpuOpsLibraryError:
        return False


def use_grad_kernels(choice: str, device_type: str = "cpu") -> bool:
    """Whether CPU builds should emit the fused ``ortrain.cpu`` backward kernels."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"cpu_kernels={choice!r}: use one of {', '.join(KERNEL_CHOICES)}")
    if choice == "onnxruntime" or device_type != "cpu":
        return False
    return _built_or_fallback(
        library_path, choice == "ortrain", "cpu_kernels='ortrain'",
        ("the fused CPU backward kernels are unavailable", "backwards run as standard ONNX ops"),
    )  # fmt: skip
