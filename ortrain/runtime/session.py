"""ONNX Runtime sessions with persistent, zero-copy bindings.

State tensors are torch tensors; ONNX Runtime sees them through OrtValues that
share their memory, bound once with IOBinding. A step rebinds only the batch.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import torch

# Keep ONNX Runtime from deleting Dropout nodes: training graphs need live masks.
DISABLED_OPTIMIZERS = ["EliminateDropout"]

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


def ortvalue(t: torch.Tensor) -> ort.OrtValue:
    """An OrtValue sharing ``t``'s memory (CPU)."""
    if not t.is_contiguous():
        raise ValueError("state tensors must be contiguous")
    return ort.OrtValue.ortvalue_from_numpy(t.detach().numpy())


def make_session(
    model: ir.Model, *, threads: int | None, save_path: str | None = None
) -> ort.InferenceSession:
    proto = ir.serde.serialize_model(model)
    data = proto.SerializeToString()
    if save_path is not None:
        with open(save_path, "wb") as f:
            f.write(data)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    # A memory pattern planned on the first run is re-allocated on the second and the
    # first run's blocks are kept: ~25% more peak RSS and a slow second step.
    so.enable_mem_pattern = False
    # Two sessions (gradient, update) alternate every step; spinning idle threads of one
    # would steal the cores from the other.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads is not None:
        so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(
        data, so, providers=["CPUExecutionProvider"], disabled_optimizers=DISABLED_OPTIMIZERS
    )


class BoundSession:
    """A session plus an IOBinding whose persistent inputs/outputs are bound once."""

    def __init__(self, session: ort.InferenceSession):
        self.session = session
        self.binding = session.io_binding()
        self.input_names = {i.name for i in session.get_inputs()}
        self.output_names = [o.name for o in session.get_outputs()]
        self._keep: list[object] = []  # OrtValues and tensors whose memory is bound
        self.bound_inputs: dict[str, ort.OrtValue] = {}  # persistent inputs, for inspection

    def bind_inputs(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            if name in self.input_names:
                ov = ortvalue(t)
                self._keep.append((ov, t))
                self.bound_inputs[name] = ov
                self.binding.bind_ortvalue_input(name, ov)

    def bind_outputs(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            ov = ortvalue(t)
            self._keep.append((ov, t))
            self.binding.bind_ortvalue_output(name, ov)

    def bind_batch(self, name: str, t: torch.Tensor) -> None:
        """Bind a batch tensor by pointer (no copy); the caller keeps ``t`` alive for the run."""
        self.binding.bind_input(name, "cpu", 0, _TORCH_TO_NP[t.dtype], list(t.shape), t.data_ptr())

    def bind_output_to_cpu(self, name: str) -> None:
        self.binding.bind_output(name, "cpu")

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)
