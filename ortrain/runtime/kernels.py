"""Fused optimizer kernels of ``cuda_kernels/`` on torch tensors, through their C ABI.

CPU tensors run the CPU reference library (``libortrain_kernels_cpu.so``), CUDA tensors
the CUDA library (``libortrain_kernels_cuda.so``) on torch's current stream, with no host
synchronisation. Both are built by the repository's ``CMakeLists.txt`` at install time
(the CUDA one where a toolkit is found) and loaded by ``ortrain.runtime.native`` from
``$ORTRAIN_KERNELS_DIR`` where set, else where ``native.library_dirs()`` says.

- ``adamw_``: Adam/AdamW (``decoupled``) over one flat fp32 shard, torch.optim semantics.
- ``lamb_phase1_`` / ``lamb_phase2_`` (or ``lamb_`` for both): ``ortrain.optim.Lamb`` over a
  flat shard cut into per-tensor segments; between the phases the caller may all-reduce
  the per-segment partial squared norms of a tensor split across shards.
- ``all_finite_sq_norm``: sum of squares and a non-finite flag in one read.

Every update takes ``grad_scale`` (a float, or a one-element fp32 tensor on the device:
1/(loss_scale * accumulation * world) times the clipping coefficient; gradients are
multiplied by it in-kernel), ``found_inf`` (a one-element fp32 tensor; non-zero: nothing
is written, bit for bit) and ``half_param`` (fp16/bf16: receives the updated parameter).
``step`` is the 1-based step t of this update; the bias corrections 1 - beta^t are
computed in double on the host, as torch does with its Python floats.

A shard may be any 1-D contiguous slice (a view with an offset) of a larger buffer, so
one call per param group's contiguous range covers a flat buffer.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from ortrain.runtime import native
from ortrain.runtime.native import NativeLibraryError

ABI_VERSION = 1  # cuda_kernels/ortrain_kernels.h: ORTRAIN_KERNELS_ABI_VERSION
LIBRARY_NAMES = {"cpu": "libortrain_kernels_cpu.so", "cuda": "libortrain_kernels_cuda.so"}
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_HALF = (torch.float16, torch.bfloat16)

# The C ABI (cuda_kernels/ortrain_kernels.h) as "return: arguments"; p pointer, q int64,
# i int, d double, s string.
_CTYPES = {"p": ctypes.c_void_p, "q": ctypes.c_int64, "i": ctypes.c_int, "d": ctypes.c_double}
_CTYPES["s"] = ctypes.c_char_p
_SIGNATURES = {
    "ortrain_kernels_abi_version": "i:",
    "ortrain_kernels_device": "s:",
    "ortrain_last_error": "s:",
    "ortrain_adam": "i: p p i p p q d d d d d d i d p p p i p",
    "ortrain_lamb_workspace_floats": "q: q q",
    "ortrain_lamb_phase1": "i: p p i p p p q p q d d d d d i d p p p p p p",
    "ortrain_lamb_phase2": "i: p p q p q p p d p p i p",
    "ortrain_sq_norm_workspace_floats": "q: q",
    "ortrain_all_finite_sq_norm": "i: p p q i p p p p",
}


KernelLibraryError = NativeLibraryError  # the name this module's callers catch


# --------------------------------------------------------------------------- loading


def search_dirs() -> list[Path]:
    """Where the libraries are looked for: ``$ORTRAIN_KERNELS_DIR`` alone where set, else
    ``native.library_dirs()`` (``$ORTRAIN_NATIVE_DIR``, else the installed package)."""
    override = os.environ.get("ORTRAIN_KERNELS_DIR")
    return [Path(override)] if override else native.library_dirs()


def library(device_type: str) -> ctypes.CDLL:
    """The kernel library for ``"cpu"`` or ``"cuda"`` tensors (found and loaded once per
    search path: the per-step cost is one dictionary lookup)."""
    if device_type not in LIBRARY_NAMES:
        raise KernelLibraryError(f"no kernel library for device type {device_type!r}")
    return _find(device_type, tuple(search_dirs()))


@functools.cache
def _find(device_type: str, dirs: tuple[Path, ...]) -> ctypes.CDLL:
    name = LIBRARY_NAMES[device_type]
    path = native.find(name, list(dirs))
    if path is not None:
        return _open(path, device_type)
    cuda = " (the CUDA one needs a CUDA toolkit: nvcc on PATH)" if device_type == "cuda" else ""
    raise KernelLibraryError(
        f"{name} not found in {', '.join(map(str, dirs)) or 'no folder (ortrain is not installed)'}"
        f": install ortrain (`pip install .` builds it{cuda}), or build it with "
        "`cmake -S . -B build && cmake --build build -j` and set ORTRAIN_NATIVE_DIR=build"
    )


def _open(path: Path, device_type: str) -> ctypes.CDLL:
    lib = native.load(path, "ortrain_kernels_abi_version", ABI_VERSION)
    lib.ortrain_kernels_device.restype = ctypes.c_char_p
    device = lib.ortrain_kernels_device().decode()
    if device != device_type:  # checked before any newer symbol
        raise KernelLibraryError(f"{path}: a {device} library, expected a {device_type} one")
    for fn, signature in _SIGNATURES.items():
        restype, args = signature.split(":")
        getattr(lib, fn).restype = _CTYPES[restype]
        getattr(lib, fn).argtypes = [_CTYPES[a] for a in args.split()]
    return lib


def _call(lib: ctypes.CDLL, fn: str, *args: object) -> None:
    if getattr(lib, fn)(*args) != 0:
        raise KernelLibraryError(f"{fn} failed: {lib.ortrain_last_error().decode()}")


def _launch(device: torch.device, fn: str, *args: object) -> None:
    """Calls ``fn(*args, stream)`` in the library for ``device``."""
    lib = library(device.type)
    if device.type == "cpu":
        _call(lib, fn, *args, None)
        return
    # The library's CUDA runtime follows the current device that torch sets here.
    with torch.cuda.device(device):
        _call(lib, fn, *args, torch.cuda.current_stream(device).cuda_stream)


# --------------------------------------------------------------------------- checks


def _check_flat(
    fn: str,
    name: str,
    t: object,
    device: torch.device,
    numel: int | None,
    dtypes: Sequence[torch.dtype] = (torch.float32,),
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{fn}: {name} must be {allowed}, got {t.dtype}")
    if t.dim() != 1 or t.stride(0) != 1:
        raise ValueError(
            f"{fn}: {name} must be 1-D and contiguous, got shape {tuple(t.shape)} "
            f"strides {t.stride()}"
        )
    if t.device != device:
        raise ValueError(f"{fn}: {name} is on {t.device}, param on {device}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{fn}: {name} has {t.numel()} elements, param has {numel}")
    return t


def _param(fn: str, param: object) -> torch.Tensor:
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"{fn}: param must be a torch.Tensor, got {type(param).__name__}")
    if param.device.type not in LIBRARY_NAMES:
        raise ValueError(f"{fn}: param is on {param.device}; the kernels run on cpu and cuda")
    return _check_flat(fn, "param", param, param.device, None)


def _scalar_tensor(fn: str, name: str, t: object, device: torch.device) -> int:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1:
        raise TypeError(f"{fn}: {name} must be a one-element float32 tensor")
    if t.device != device:
        raise ValueError(f"{fn}: {name} is on {t.device}, param on {device}")
    return t.data_ptr()


def _grad_scale(
    fn: str, grad_scale: float | torch.Tensor, device: torch.device
) -> tuple[float, int | None]:
    """(host factor, device pointer or None): a tensor scale stays on the device."""
    if isinstance(grad_scale, torch.Tensor):
        return 1.0, _scalar_tensor(fn, "grad_scale", grad_scale, device)
    return float(grad_scale), None


def _found_inf(fn: str, found_inf: torch.Tensor | None, device: torch.device) -> int | None:
    return None if found_inf is None else _scalar_tensor(fn, "found_inf", found_inf, device)


def _half(fn: str, half_param: torch.Tensor | None, param: torch.Tensor) -> tuple[int | None, int]:
    if half_param is None:
        return None, 0
    _check_flat(fn, "half_param", half_param, param.device, param.numel(), _HALF)
    return half_param.data_ptr(), _DTYPE_CODES[half_param.dtype]


def _grad(fn: str, grad: object, param: torch.Tensor) -> torch.Tensor:
    return _check_flat(fn, "grad", grad, param.device, param.numel(), tuple(_DTYPE_CODES))


def _check_step(fn: str, step: float) -> float:
    if not step >= 1:
        raise ValueError(f"{fn}: step is the 1-based step of this update, got {step}")
    return float(step)


# --------------------------------------------------------------------------- Adam / AdamW


def adamw_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: float,
    grad_scale: float | torch.Tensor = 1.0,
    found_inf: torch.Tensor | None = None,
    half_param: torch.Tensor | None = None,
    decoupled: bool = True,
) -> None:
    """One AdamW step (``decoupled=False``: Adam with L2 decay) in place, in one pass.

    ``param``, ``exp_avg``, ``exp_avg_sq``: flat fp32; ``grad``: fp32, fp16 or bf16.
    Same result as ``torch.optim.AdamW`` (single-tensor) on ``grad * grad_scale``.
    """
    fn = "adamw_"
    param = _param(fn, param)
    dev, n = param.device, param.numel()
    grad = _grad(fn, grad, param)
    _check_flat(fn, "exp_avg", exp_avg, dev, n)
    _check_flat(fn, "exp_avg_sq", exp_avg_sq, dev, n)
    scale, scale_ptr = _grad_scale(fn, grad_scale, dev)
    half_ptr, half_code = _half(fn, half_param, param)
    _launch(
        dev, "ortrain_adam", param.data_ptr(), grad.data_ptr(), _DTYPE_CODES[grad.dtype],
        exp_avg.data_ptr(), exp_avg_sq.data_ptr(), n, lr, beta1, beta2, eps, weight_decay,
        _check_step(fn, step), int(decoupled), scale, scale_ptr, _found_inf(fn, found_inf, dev),
        half_ptr, half_code,
    )  # fmt: skip


# --------------------------------------------------------------------------- LAMB


def segment_offsets(lengths: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """The int64 ``[0, l0, l0 + l1, ...]`` offsets of consecutive segments, on ``device``:
    build it once per shard layout and pass it to every LAMB call."""
    if any(n < 0 for n in lengths):
        raise ValueError(f"segment lengths must be >= 0, got {list(lengths)}")
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(list(lengths), dtype=torch.int64).cumsum(0)
    return offsets.to(device)


def _segments(fn: str, offsets: object, param: torch.Tensor) -> torch.Tensor:
    if not isinstance(offsets, torch.Tensor):
        offsets = torch.tensor(list(offsets), dtype=torch.int64)  # type: ignore[call-overload]
    if offsets.dtype != torch.int64 or offsets.dim() != 1 or offsets.numel() < 2:
        raise ValueError(f"{fn}: segment_offsets must be 1-D int64 with >= 2 entries")
    if offsets.device.type == "cpu":  # checked here; on the device it would cost a sync
        first, last = int(offsets[0]), int(offsets[-1])
        if first != 0 or last != param.numel() or bool((offsets[1:] < offsets[:-1]).any()):
            raise ValueError(
                f"{fn}: segment_offsets must ascend from 0 to param.numel() = "
                f"{param.numel()}, got {offsets.tolist()}"
            )
    return offsets.to(param.device).contiguous()


def lamb_phase1_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    update: torch.Tensor,
    segment_offsets: Sequence[int] | torch.Tensor,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: float,
    bias_correction: bool = True,
    grad_scale: float | torch.Tensor = 1.0,
    found_inf: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LAMB phase 1: updates ``exp_avg``/``exp_avg_sq``, writes the update direction into
    ``update`` (flat fp32) and returns the per-segment partial squared norms
    ``(param_sq, update_sq)`` (fp32, one per segment). ``param`` is not written.

    Segment k is ``[offsets[k], offsets[k + 1])``: the part of one parameter tensor in
    this shard. A CUDA offsets tensor is trusted as is (``segment_offsets()`` builds one).
    """
    fn = "lamb_phase1_"
    param = _param(fn, param)
    dev, n = param.device, param.numel()
    grad = _grad(fn, grad, param)
    _check_flat(fn, "exp_avg", exp_avg, dev, n)
    _check_flat(fn, "exp_avg_sq", exp_avg_sq, dev, n)
    _check_flat(fn, "update", update, dev, n)
    offsets = _segments(fn, segment_offsets, param)
    nseg = offsets.numel() - 1
    param_sq = torch.empty(nseg, dtype=torch.float32, device=dev)
    update_sq = torch.empty(nseg, dtype=torch.float32, device=dev)
    ws = library(dev.type).ortrain_lamb_workspace_floats(n, nseg)
    workspace = torch.empty(ws, dtype=torch.float32, device=dev)
    scale, scale_ptr = _grad_scale(fn, grad_scale, dev)
    _launch(
        dev, "ortrain_lamb_phase1", param.data_ptr(), grad.data_ptr(), _DTYPE_CODES[grad.dtype],
        exp_avg.data_ptr(), exp_avg_sq.data_ptr(), update.data_ptr(), n, offsets.data_ptr(),
        nseg, beta1, beta2, eps, weight_decay, _check_step(fn, step), int(bias_correction),
        scale, scale_ptr, _found_inf(fn, found_inf, dev), param_sq.data_ptr(),
        update_sq.data_ptr(), workspace.data_ptr(),
    )  # fmt: skip
    return param_sq, update_sq


def lamb_phase2_(
    param: torch.Tensor,
    update: torch.Tensor,
    segment_offsets: Sequence[int] | torch.Tensor,
    param_sq: torch.Tensor,
    update_sq: torch.Tensor,
    *,
    lr: float,
    found_inf: torch.Tensor | None = None,
    half_param: torch.Tensor | None = None,
) -> None:
    """LAMB phase 2: ``p -= lr * trust * update`` per segment, trust = ||p|| / ||u|| from
    the (possibly all-reduced) squared norms when both are > 0, else 1."""
    fn = "lamb_phase2_"
    param = _param(fn, param)
    dev, n = param.device, param.numel()
    _check_flat(fn, "update", update, dev, n)
    offsets = _segments(fn, segment_offsets, param)
    nseg = offsets.numel() - 1
    _check_flat(fn, "param_sq", param_sq, dev, nseg)
    _check_flat(fn, "update_sq", update_sq, dev, nseg)
    half_ptr, half_code = _half(fn, half_param, param)
    _launch(
        dev, "ortrain_lamb_phase2", param.data_ptr(), update.data_ptr(), n, offsets.data_ptr(),
        nseg, param_sq.data_ptr(), update_sq.data_ptr(), lr, _found_inf(fn, found_inf, dev),
        half_ptr, half_code,
    )  # fmt: skip


def lamb_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    segment_offsets: Sequence[int] | torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: float,
    bias_correction: bool = True,
    grad_scale: float | torch.Tensor = 1.0,
    found_inf: torch.Tensor | None = None,
    half_param: torch.Tensor | None = None,
    update: torch.Tensor | None = None,
) -> None:
    """Both LAMB phases for a shard whose segments are whole tensors (no all-reduce).
    ``update``: scratch for the update direction (allocated when None)."""
    offsets = _segments("lamb_", segment_offsets, _param("lamb_", param))
    if update is None:
        update = torch.empty_like(param)
    param_sq, update_sq = lamb_phase1_(
        param, grad, exp_avg, exp_avg_sq, update, offsets, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, step=step, bias_correction=bias_correction,
        grad_scale=grad_scale, found_inf=found_inf,
    )  # fmt: skip
    lamb_phase2_(
        param, update, offsets, param_sq, update_sq, lr=lr, found_inf=found_inf,
        half_param=half_param,
    )  # fmt: skip


# --------------------------------------------------------------------------- norm


def all_finite_sq_norm(
    tensors: torch.Tensor | Sequence[torch.Tensor],
    *,
    sq_norm: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of squares, found_inf)`` over one or several contiguous tensors of one dtype
    (fp32, fp16 or bf16) in one read; both fp32 on their device. ``found_inf`` is 1 when an
    element, or the fp32 sum itself, is not finite (the update graph's rule), else 0.
    Pass ``sq_norm``/``found_inf`` (one-element fp32) to have them written in place."""
    fn = "all_finite_sq_norm"
    items = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if not items:
        raise ValueError(f"{fn}: no tensors given")
    first = items[0]
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPE_CODES or t.dtype != first.dtype:
            raise TypeError(
                f"{fn}: tensors[{i}] is {t.dtype}; all must share one of float32, float16, "
                f"bfloat16 (tensors[0] is {first.dtype})"
            )
        if t.device != first.device or t.device.type not in LIBRARY_NAMES:
            raise ValueError(f"{fn}: tensors[{i}] is on {t.device}, tensors[0] on {first.device}")
        if not t.is_contiguous():
            raise ValueError(f"{fn}: tensors[{i}] must be contiguous")
    dev = first.device
    if sq_norm is None:
        sq_norm = torch.empty((), dtype=torch.float32, device=dev)
    if found_inf is None:
        found_inf = torch.empty((), dtype=torch.float32, device=dev)
    _scalar_tensor(fn, "sq_norm", sq_norm, dev)
    _scalar_tensor(fn, "found_inf", found_inf, dev)
    k = len(items)
    ptrs = (ctypes.c_void_p * k)(*(t.data_ptr() for t in items))
    lens = (ctypes.c_int64 * k)(*(t.numel() for t in items))
    ws = library(dev.type).ortrain_sq_norm_workspace_floats(k)
    workspace = torch.empty(ws, dtype=torch.float32, device=dev)
    _launch(
        dev, "ortrain_all_finite_sq_norm", ptrs, lens, k, _DTYPE_CODES[first.dtype],
        sq_norm.data_ptr(), found_inf.data_ptr(), workspace.data_ptr(),
    )  # fmt: skip
    return sq_norm, found_inf


__all__ = [
    "ABI_VERSION",
    "KernelLibraryError",
    "adamw_",
    "all_finite_sq_norm",
    "lamb_",
    "lamb_phase1_",
    "lamb_phase2_",
    "library",
    "search_dirs",
    "segment_offsets",
]
