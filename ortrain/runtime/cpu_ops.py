"""ortrain's CPU custom-op library: loaded through ``native``, registered on CPU sessions.

One shared library from the C files beside this module (``ort_abi.h`` declares the ONNX
Runtime ABI they use), with two op domains:

- ``ortrain.cpu``: fused fp32 kernels (``grad_kernels.c``: GeluGrad, FastGeluGrad,
  SoftmaxGrad, LayerNormGrad; forward, layout, element-wise and update kernels) that CPU
  builds emit (``use_grad_kernels``, ``TrainerOptions.cpu_kernels``);
- ``ortrain.blas``: ``Gemm`` on the BLAS sgemm torch's CPU library exports (MKL in x86
  wheels; ``blas_gemm.c``): no second BLAS is loaded, and the products run on the same
  OpenMP threads, at the same rates, as eager torch's. Registered only once the library
  was bound to torch's ``libtorch_cpu`` (``blas_library_path``).

``CMakeLists.txt`` builds it at install time once per instruction set
(``libortrain_cpu_ops_{baseline,avx2,avx512}.so``); ``native.cpu_isa()`` picks the variant
once per process (``ORTRAIN_CPU_ISA`` overrides). Where no installed library is found (a
source tree that was never installed), it is compiled on first use as a development
fallback: the same per-ISA flags, with the system C compiler, into ``$ORTRAIN_CACHE_DIR``
(default ``$XDG_CACHE_HOME/ortrain``, else ``~/.cache/ortrain``), a folder that only this
user may write; the SHA-256 of what was built is stored beside it and checked before every
load (a mismatch: rebuilt).

``use_blas_gemm(choice)`` resolves ``TrainerOptions.cpu_gemm``: "auto" takes the BLAS op
on Intel CPUs when torch was built with MKL (on AMD EPYC, MLAS measured faster than
MKL: DESIGN.md), "blas" takes it wherever the library loads (and fails with the reason
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
from collections.abc import Callable
from pathlib import Path

import torch

from ortrain.runtime import native
from ortrain.runtime.native import NativeLibraryError
from ortrain.safe_files import UntrustedPathError, atomic_write, private_dir

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
        "dropout_kernels.c",
    )
)
HEADERS = (_HERE / "ort_abi.h", _HERE / "kernel_util.h", _HERE / "adam_math.h")
ABI_VERSION = 8  # cpu_ops.c: ortrain_cpu_ops_abi_version
CHOICES = ("auto", "blas", "onnxruntime")
KERNEL_CHOICES = ("auto", "ortrain", "onnxruntime")
# The compiler flags of each variant: CMakeLists.txt's ISA_FLAGS_* (the development build)
ISA_FLAGS = {
    "baseline": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512dq", "-mprefer-vector-width=512"],
}  # fmt: skip

CpuOpsLibraryError = NativeLibraryError  # the name this module's callers catch


def library_name(isa: str) -> str:
    return f"libortrain_cpu_ops_{isa}.so"


def cache_dir() -> Path:
    """The development build's folder: ``$ORTRAIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/ortrain``,
    else ``~/.cache/ortrain``."""
    if os.environ.get("ORTRAIN_CACHE_DIR"):
        return Path(os.environ["ORTRAIN_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache") / "ortrain"


def _compiler() -> str:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    raise CpuOpsLibraryError("no C compiler (cc, gcc or clang on PATH, or $CC) to build it with")


def _torch_cpu_library() -> Path:
    """torch's CPU library, the declared provider of the BLAS ``ortrain.blas`` calls."""
    lib_dir = Path(torch.__file__).resolve().parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        if (lib_dir / name).is_file():
            return lib_dir / name
    raise CpuOpsLibraryError(f"no libtorch_cpu in {lib_dir}: torch's BLAS cannot be bound")


def _torch_sgemm() -> int:
    """The address of torch's exported ``sgemm_`` (raises where it has none)."""
    return _torch_blas()[0]


def _torch_blas() -> tuple[int, int | None]:
    """The addresses of torch's exported ``sgemm_`` and (MKL only) ``sgemm_batch_``: what
    ``ortrain_blas_bind`` finds with dlsym (tests, and whether sgemm_batch exists)."""
    path = _torch_cpu_library()
    try:
        lib = ctypes.CDLL(str(path))
        address = ctypes.cast(lib.sgemm_, ctypes.c_void_p).value
    except (OSError, AttributeError) as exc:
        raise CpuOpsLibraryError(f"torch's CPU library exports no sgemm_ ({path}: {exc})") from None
    if not address:
        raise CpuOpsLibraryError(f"torch's CPU library exports no sgemm_ ({path}: null address)")
    batch = getattr(lib, "sgemm_batch_", None)
    return address, ctypes.cast(batch, ctypes.c_void_p).value if batch else None


@functools.cache
def _library() -> tuple[Path, ctypes.CDLL]:
    isa = native.cpu_isa()
    path = native.find(library_name(isa)) or _development_build(isa)
    lib = native.load(path, "ortrain_cpu_ops_abi_version", ABI_VERSION)
    lib.ortrain_cpu_ops_isa.restype = ctypes.c_char_p
    built = lib.ortrain_cpu_ops_isa().decode()
    if built != isa:
        raise CpuOpsLibraryError(f"{path}: the {built} variant, expected {isa}")
    lib.ortrain_use_omp_team(int(_same_openmp(lib)))
    return path, lib


def isa() -> str:
    """The instruction-set variant of the loaded library (loading it if need be)."""
    _library()
    return native.cpu_isa()


def _torch_openmp_symbol() -> int | None:
    """The address of the ``omp_get_max_threads`` torch's CPU library calls, or None."""
    try:
        lib = ctypes.CDLL(str(_torch_cpu_library()))
        return ctypes.cast(lib.omp_get_max_threads, ctypes.c_void_p).value
    except (OSError, AttributeError, CpuOpsLibraryError):
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
    """Whether the loaded library runs its kernels on torch's OpenMP team."""
    return bool(ctypes.c_int.in_dll(_library()[1], "ortrain_omp_team").value)


def library_path() -> Path:
    """The library, ready for ``register_custom_ops_library`` (loaded once per process).
    Raises ``CpuOpsLibraryError`` with the reason."""
    return _library()[0]


@functools.cache
def blas_library_path() -> Path:
    """``library_path()``, bound to torch's BLAS so that it registers ``ortrain.blas.Gemm``
    and ``BatchMatMul`` too: the library itself opens ``libtorch_cpu`` (already loaded by
    ``import torch``: no second copy) and looks up ``sgemm_`` (and MKL's ``sgemm_batch_``)
    with dlsym, so only a symbol that file exports is ever called."""
    path, lib = _library()
    torch_cpu = _torch_cpu_library()
    lib.ortrain_blas_bind.argtypes = [ctypes.c_char_p]
    lib.ortrain_blas_bind.restype = ctypes.c_int
    rc = lib.ortrain_blas_bind(os.fsencode(torch_cpu))
    if rc == -1:
        raise CpuOpsLibraryError(f"{path} cannot open torch's CPU library {torch_cpu}")
    if rc != 0:
        raise CpuOpsLibraryError(f"torch's CPU library exports no sgemm_ ({torch_cpu})")
    return path


def cache_clear() -> None:
    """Forget the loaded library (tests: a changed cache folder, compiler or variant)."""
    _library.cache_clear()
    blas_library_path.cache_clear()


# --------------------------------------------------------------------------- development build


def _native_flags() -> list[str]:
    """-fopenmp-simd: the kernels' `omp simd` pragmas (the build drops it where refused)."""
    return ["-fopenmp-simd"]


def _openmp_flags() -> list[str]:
    """-fopenmp where torch runs on GNU OpenMP (its wheel ships ``libgomp.so.1``, which the
    library's own ``libgomp.so.1`` then resolves to once torch is loaded): the kernels
    share torch's thread team (``_same_openmp`` checks at load time)."""
    lib_dir = Path(torch.__file__).resolve().parent / "lib"
    return ["-fopenmp"] if any(lib_dir.glob("libgomp*.so*")) else []


def _private_dir(folder: Path) -> Path:
    """``folder``, created (0700) if need be; refused when another user owns it or may write
    it, or a folder above it (they could swap the library ortrain is about to load): the
    rule of ``ortrain/safe_files.py``, which the graph cache follows too."""
    try:
        return private_dir(folder)
    except UntrustedPathError as exc:
        raise CpuOpsLibraryError(
            f"{exc}; `chmod go-w` it if it is yours, or set ORTRAIN_CACHE_DIR"
        ) from None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _development_build(isa: str) -> Path:
    """The library compiled from this folder's sources (no installed one was found): built
    once per source, compiler and flags, its hash stored beside it and checked here."""
    cc = _compiler()
    flags = [*ISA_FLAGS[isa], *_native_flags(), *_openmp_flags()]
    digest = hashlib.sha256(cc.encode() + " ".join(flags).encode())
    for f in SOURCES + HEADERS:
        digest.update(f.read_bytes())
    path = cache_dir() / f"libortrain_cpu_ops_{isa}-{digest.hexdigest()[:16]}.so"
    stamp = path.with_name(path.name + ".sha256")
    try:
        _private_dir(path.parent)
        if path.is_file():
            if stamp.is_file() and stamp.read_text().strip() == _sha256(path):
                return path
            warnings.warn(
                f"ortrain: {path} does not match the hash stored when it was built; rebuilding it",
                RuntimeWarning,
                stacklevel=2,
            )
        _compile(cc, isa, path)
        digest = _sha256(path) + "\n"
        atomic_write(stamp, lambda f: f.write(digest.encode()))
    except OSError as exc:  # an unwritable cache folder, a compiler that cannot run
        raise CpuOpsLibraryError(f"cannot build {path}: {exc}") from None
    return path


def _compile(cc: str, isa: str, path: Path) -> None:
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        # no errno from sqrtf & co.: a loop calling them vectorizes (the kernels never read it)
        base = [cc, "-O3", "-fno-math-errno", "-shared", "-fPIC", "-o", str(out)]
        base += [f'-DORTRAIN_CPU_ISA="{isa}"', *map(str, SOURCES), "-lm", "-ldl"]
        required, simd, openmp = ISA_FLAGS[isa], _native_flags(), _openmp_flags()
        # the fullest build the compiler accepts: a missing OpenMP runtime or an unknown
        # -fopenmp-simd drops those flags, never the variant's instruction set
        tries = [[*required, *simd, *openmp], [*required, *simd], required]
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
    only with it: graph_passes/targets/cpu/blas_batch_matmul.py)."""
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
