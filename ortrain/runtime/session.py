"""ONNX Runtime sessions with persistent, zero-copy bindings, on CPU or CUDA.

State tensors are torch tensors; ONNX Runtime reads and writes their memory directly:
IOBinding binds each one by device and data pointer, once. A step rebinds only the
batch. On CUDA the session runs on a torch stream the trainer owns
(``user_compute_stream``), so torch work before and after a run (batch copies, fused
kernels, collectives) is ordered with it without host synchronisation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort
import torch

from ortrain.build import BuiltGraph
from ortrain.errors import DeviceError

if TYPE_CHECKING:
    import onnx_ir as ir

# Keep ONNX Runtime from deleting Dropout nodes: training graphs need live masks.
DISABLED_OPTIMIZERS = ["EliminateDropout"]
# Graphs with recomputed copies (graph_passes/recompute.py) also keep ONNX Runtime's CSE
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


def providers(
    device: torch.device, stream: torch.cuda.Stream | None = None, cuda_graph: bool = False
) -> list:
    if device.type == "cpu":
        return ["CPUExecutionProvider"]
    options: dict[str, str] = {"device_id": str(device.index or 0)}
    if stream is not None:  # torch's default stream is 0, which ORT reads as "none"
        options["user_compute_stream"] = str(stream.cuda_stream)
    if cuda_graph:
        options["enable_cuda_graph"] = "1"
    return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]


# One CPU arena for all of ortrain's sessions (gradient graphs, update, eval), so that a
# graph per label-row count (graph_passes/label_sparsity.py) does not keep an activation
# arena of its own. Sessions opt in one by one: other sessions of the process are
# unaffected.
_arena_registered = False


def _register_cpu_arena() -> None:
    global _arena_registered
    if not _arena_registered:
        info = ort.OrtMemoryInfo(
            "Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT
        )
        with contextlib.suppress(Exception):  # one registered already: use that one
            ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))
        _arena_registered = True


def _serialized(model: ir.Model) -> tuple[bytes, bool]:
    """(the model ordered for ONNX Runtime, serialized; whether it has recomputed copies)."""
    import onnx_ir as ir

    from graph_passes.ort_order import order_for_ort
    from graph_passes.tags import RECOMPUTE_OF

    recomputes = any(RECOMPUTE_OF in n.metadata_props for n in model.graph)
    proto = ir.serde.serialize_model(model)
    order_for_ort(proto.graph)
    return proto.SerializeToString(), recomputes


def make_session(
    model: ir.Model | BuiltGraph,
    *,
    threads: int | None,
    save_path: str | None = None,
    device: torch.device | None = None,
    stream: torch.cuda.Stream | None = None,
    cuda_graph: bool = False,
) -> ort.InferenceSession:
    if isinstance(model, BuiltGraph):  # built apart (ortrain/build.py): ordered already
        data, recomputes = model.ort_data, model.recomputes
    else:
        data, recomputes = _serialized(model)
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
    if device.type == "cpu":
        _register_cpu_arena()
        so.add_session_config_entry("session.use_env_allocators", "1")
    return ort.InferenceSession(
        data,
        so,
        providers=providers(device, stream, cuda_graph),
        disabled_optimizers=DISABLED_OPTIMIZERS + (RECOMPUTE_DISABLED if recomputes else []),
    )


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
