"""ONNX Runtime sessions with persistent, zero-copy bindings, on CPU or CUDA.

State tensors are torch tensors; ONNX Runtime reads and writes their memory directly:
IOBinding binds each one by device and data pointer, once. A step rebinds only the
batch. On CUDA the session runs on a torch stream the trainer owns
(``user_compute_stream``), so torch work before and after a run (batch copies, fused
kernels, collectives) is ordered with it without host synchronisation.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort
import torch

from ortrain.build import BuiltGraph, serialize_for_ort
from ortrain.core.errors import DeviceError
from ortrain.core.names import BLAS_DOMAIN, CPU_DOMAIN
from ortrain.runtime import cpu_ops

if TYPE_CHECKING:
    import onnx_ir as ir

# Keep ONNX Runtime from deleting Dropout nodes: training graphs need live masks.
DISABLED_OPTIMIZERS = ["EliminateDropout"]
# Graphs with recomputed copies (graph_passes/memory/recompute.py) also keep ONNX Runtime's CSE
# off: it would merge each copy back into the forward value it stands in for.
RECOMPUTE_DISABLED = ["CommonSubexpressionElimination"]

_TORCH_TO_NP = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.float64: np.float64,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.bool: np.bool_,
    torch.uint8: np.uint8,
    torch.int8: np.int8,
}


def cuda_available() -> bool:
    return torch.cuda.is_available() and "CUDAExecutionProvider" in ort.get_available_providers()


def check_device(device: torch.device) -> None:
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise DeviceError(f"device {device}: ortrain runs on 'cpu' or 'cuda[:N]'")
    if not torch.cuda.is_available():
        raise DeviceError(f"device {device}: torch sees no CUDA device on this machine")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise DeviceError(
            f"device {device}: this onnxruntime ({ort.__version__}) has no "
            "CUDAExecutionProvider; install ortrain[gpu] (onnxruntime-gpu) instead of onnxruntime"
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise DeviceError(f"device {device}: only {torch.cuda.device_count()} CUDA devices")
    _preload_cuda_libraries()


@functools.cache
def _preload_cuda_libraries() -> None:
    # onnxruntime-gpu finds CUDA/cuDNN through the loader's path; pip-installed ones (the
    # nvidia-* wheels torch brings) are not on it. preload_dlls loads them by path (torch
    # imported first: its copies are reused).
    preload = getattr(ort, "preload_dlls", None)  # onnxruntime >= 1.21
    if preload is None:
        return
    try:
        preload(msvc=False)
    except Exception as e:  # the session's own load then reports what is missing
        warnings.warn(f"onnxruntime.preload_dlls failed: {e}", RuntimeWarning, stacklevel=3)


def providers(
    device: torch.device, stream: torch.cuda.Stream | None = None, cuda_graph: bool = False
) -> list:
    if device.type == "cpu":
        return ["CPUExecutionProvider"]
    options: dict[str, str] = {"device_id": str(device.index or 0)}
    # ONNX Runtime's CUDA provider runs fp32 GEMMs in TF32 unless told otherwise; torch
    # does not by default. Follow torch's setting so that fp32 means the same in both.
    options["use_tf32"] = "0" if torch.get_float32_matmul_precision() == "highest" else "1"
    if stream is not None:  # torch's default stream is 0, which ORT reads as "none"
        options["user_compute_stream"] = str(stream.cuda_stream)
    if cuda_graph:
        options["enable_cuda_graph"] = "1"
    return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]


# One CPU arena for all of ortrain's sessions (gradient graphs, update, eval), so that a
# graph per label-row count (graph_passes/training/label_sparsity.py) does not keep an activation
# arena of its own. Sessions opt in one by one: other sessions of the process are
# unaffected.
#
# Its first region is half the planned activation peak of the first graph that asks (the
# gradient graph: memory_plan.planned_peak_bytes). ONNX Runtime's BFC arena starts at
# 1 MiB and adds regions of twice the size: a run spreads over a dozen regions, and a
# large tensor that fits in none of their free chunks (GPT-2 small's 98 MiB logits)
# opens a new one. Regions of p/2, p, 2p hold a run that needs p in the first two
# (GPT-2 small batch 2 x 256: steady peak RSS 2908 -> 2759 MiB; tiny GPT-2/BERT within
# +-6 MiB at batch 8..152). A first region of the whole peak was worse: the run spilled
# into a doubled 2p region (BERT-tiny batch 128: +900 MiB). Pages are touched only when
# used, so the regions cost address space before they cost memory.
_arena_registered = False
_MIB = 1 << 20


def register_cpu_arena(planned_peak_bytes: int = 0) -> None:
    """Create the shared CPU arena, its first region half ``planned_peak_bytes`` (rounded
    up to MiB; ONNX Runtime's default, 1 MiB, when that is smaller). Later calls do
    nothing."""
    global _arena_registered
    if _arena_registered:
        return
    cfg: dict[str, int] = {}
    first = -(-planned_peak_bytes // (2 * _MIB)) * _MIB
    if first > _MIB:
        cfg["initial_chunk_size_bytes"] = first
    info = ort.OrtMemoryInfo(
        "Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT
    )
    with contextlib.suppress(Exception):  # one registered already: use that one
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(cfg))
    _arena_registered = True


def make_session(
    model: ir.Model | BuiltGraph,
    *,
    threads: int | None,
    save_path: str | None = None,
    device: torch.device | None = None,
    stream: torch.cuda.Stream | None = None,
    cuda_graph: bool = False,
) -> ort.InferenceSession:
    arena_bytes = 0
    if isinstance(model, BuiltGraph):  # built apart (ortrain/build.py): ordered already
        data, recomputes = model.ort_data, model.recomputes
        arena_bytes, blas, kernels = model.planned_peak_bytes, model.blas_gemm, model.cpu_kernels
    else:
        data, recomputes = serialize_for_ort(model)
        blas = BLAS_DOMAIN in model.opset_imports
        kernels = CPU_DOMAIN in model.opset_imports
    if save_path is not None:
        with open(save_path, "wb") as f:
            f.write(data)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    # A memory pattern planned on the first run is re-allocated on the second and the
    # first run's blocks are kept: ~25% more peak RSS and a slow second step.
    so.enable_mem_pattern = False
    device = device or torch.device("cpu")
    # Two sessions (gradient, update) alternate every step; spinning idle threads of one
    # would steal the cores from the other.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads is not None:
        so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    if blas:  # ortrain.blas.Gemm nodes (graph_passes/targets/cpu/blas_gemm.py)
        so.register_custom_ops_library(str(cpu_ops.blas_library_path()))
    elif kernels:  # ortrain.cpu fused backward kernels (rules/nn.py)
        so.register_custom_ops_library(str(cpu_ops.library_path()))
    if device.type == "cpu":
        register_cpu_arena(arena_bytes)
        so.add_session_config_entry("session.use_env_allocators", "1")
    else:
        so.add_session_config_entry(_RECORD_ASSIGNMENT, "1")
    disabled = DISABLED_OPTIMIZERS + (RECOMPUTE_DISABLED if recomputes else [])

    def new(capture: bool) -> ort.InferenceSession:
        return ort.InferenceSession(
            data, so, providers=providers(device, stream, capture), disabled_optimizers=disabled
        )

    if device.type == "cpu":
        return new(False)
    try:
        session = new(cuda_graph)
    except Exception as exc:
        if not cuda_graph or "graph capture" not in str(exc):
            raise
        off = nodes_not_on(new(False), _CUDA)
        raise DeviceError(
            "cuda_graph=True: ONNX Runtime captures a CUDA graph only when every node runs "
            f"on CUDA, and {_describe(off) or 'some nodes'} run on the CPU (its CUDA provider "
            "has no kernel for them); train with cuda_graph=False"
        ) from exc
    off = nodes_not_on(session, _CUDA)
    if off:
        warnings.warn(
            f"{_describe(off)} run on the CPU under ONNX Runtime's CUDA provider (no CUDA "
            "kernel): each step copies their inputs between the GPU and the host",
            RuntimeWarning,
            stacklevel=2,
        )
    return session


_CUDA = "CUDAExecutionProvider"
_RECORD_ASSIGNMENT = "session.record_ep_graph_assignment_info"


def nodes_not_on(session: ort.InferenceSession, provider: str) -> list[tuple[str, str]]:
    """(op type, node name) of the nodes ONNX Runtime assigned to a provider other than
    ``provider`` (sessions created with ``session.record_ep_graph_assignment_info``);
    empty where this onnxruntime cannot say (older than 1.31)."""
    get = getattr(session, "get_provider_graph_assignment_info", None)
    if get is None:
        return []
    try:
        subgraphs = get()
    except Exception:  # recording off, or not implemented by this build
        return []
    return [
        (n.op_type, n.name) for sg in subgraphs if sg.ep_name != provider for n in sg.get_nodes()
    ]


def _describe(nodes: list[tuple[str, str]], limit: int = 5) -> str:
    shown = ", ".join(f"{op} '{name}'" for op, name in nodes[:limit])
    more = f" and {len(nodes) - limit} more" if len(nodes) > limit else ""
    return f"{len(nodes)} node(s) ({shown}{more})" if nodes else ""


def _where(t: torch.Tensor) -> tuple[str, int]:
    if t.device.type == "cuda":
        return "cuda", t.device.index or 0
    return "cpu", 0


class BoundSession:
    """A session plus an IOBinding whose persistent inputs/outputs are bound once."""

    def __init__(self, session: ort.InferenceSession):
        self.session = session
        self.binding = session.io_binding()
        self.input_names = {i.name for i in session.get_inputs()}
        self.output_names = [o.name for o in session.get_outputs()]
        self._keep: list[torch.Tensor] = []  # tensors whose memory is bound
        self.bound_inputs: dict[str, torch.Tensor] = {}  # persistent inputs, for inspection

    @staticmethod
    def _check(name: str, t: torch.Tensor) -> None:
        if not t.is_contiguous():
            raise ValueError(f"'{name}': tensors bound to ONNX Runtime must be contiguous")
        if t.dtype not in _TORCH_TO_NP:
            raise TypeError(f"'{name}': dtype {t.dtype} cannot be bound to ONNX Runtime")

    def bind_inputs(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            if name in self.input_names:
                self._check(name, t)
                self._keep.append(t)
                self.bound_inputs[name] = t
                self.bind_batch(name, t)

    def bind_outputs(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            self._check(name, t)
            self._keep.append(t)
            kind, index = _where(t)
            self.binding.bind_output(
                name, kind, index, _TORCH_TO_NP[t.dtype], list(t.shape), t.data_ptr()
            )

    def bind_batch(self, name: str, t: torch.Tensor) -> None:
        """Bind a tensor by pointer (no copy); the caller keeps ``t`` alive for the run."""
        kind, index = _where(t)
        self.binding.bind_input(
            name, kind, index, _TORCH_TO_NP[t.dtype], list(t.shape), t.data_ptr()
        )

    def bind_output_to_cpu(self, name: str) -> None:
        self.binding.bind_output(name, "cpu")

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)
