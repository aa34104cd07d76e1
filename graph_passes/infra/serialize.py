"""A graph serialized for ONNX Runtime: the pipeline's serialized passes (node order,
kernel threads) run on the proto, the ``onnx_ir`` model keeps its own order."""

from __future__ import annotations

import onnx
import onnx_ir as ir

from ortrain.graph_passes.infra.pipeline import run_pipeline
from ortrain.graph_passes.infra.tags import RECOMPUTE_OF

__all__ = ["Serialized", "serialize_for_ort"]


class Serialized:
    """The pipeline's serialization (``run_pipeline``'s ``serialize``): keeps the model's
    bytes in its own order (``data``) and the proto the serialized passes then prepare for
    ONNX Runtime (node order, kernel threads; neither changes what the graph computes)."""

    def __init__(self, keep_data: bool = True) -> None:
        self.keep_data = keep_data  # False: only the proto for ONNX Runtime is wanted
        self.data = b""
        self.proto: onnx.ModelProto | None = None

    def __call__(self, model: ir.Model) -> onnx.ModelProto:
        self.proto = ir.serde.serialize_model(model)
        if self.keep_data:
            self.data = self.proto.SerializeToString()
        return self.proto

    def ort_data(self, model: ir.Model) -> bytes:
        if self.proto is None:  # a pipeline without serialized passes
            self(model)
        assert self.proto is not None
        return self.proto.SerializeToString()


def serialize_for_ort(model: ir.Model) -> tuple[bytes, bool]:
    """(the model prepared for ONNX Runtime, serialized; whether it has recomputed copies)."""
    from ortrain.graph_passes.training_pipeline import serialized_passes  # it lists these

    serialized = Serialized(keep_data=False)
    run_pipeline(model, serialized_passes(), serialize=serialized)
    recomputes = any(RECOMPUTE_OF in n.metadata_props for n in model.graph)
    return serialized.ort_data(model), recomputes
