"""Tensors bound to an ONNX Runtime session by pointer (ortrain/runtime/session.py)."""

from __future__ import annotations

import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from ortrain.runtime.session import BoundSession


def _session() -> ort.InferenceSession:
    """``y = x @ w`` (``w`` of no columns: ``y`` has no elements) and ``s = sum(x)``."""
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["y"]),
            helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        ],
        "zero",
        [
            helper.make_tensor_value_info("x", f, [2, 4]),
            helper.make_tensor_value_info("w", f, [4, 0]),
        ],
        [helper.make_tensor_value_info("y", f, [2, 0]), helper.make_tensor_value_info("s", f, [])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_tensors_of_no_elements_bind_as_inputs_and_outputs():
    """torch gives a tensor of no elements no data pointer (0), which ONNX Runtime refuses
    for an output: a zero-size parameter's gradient in a segment (nn.AdaptiveLogSoftmaxWithLoss
    with a cluster of no classes) stopped its segment."""
    w, y = torch.empty(4, 0), torch.empty(2, 0)
    assert w.data_ptr() == 0 and y.data_ptr() == 0  # what the binding must get around
    sess = BoundSession(_session())
    x, s = torch.randn(2, 4), torch.zeros(())
    sess.bind_inputs({"x": x, "w": w})
    sess.bind_outputs({"y": y, "s": s})
    sess.run()
    torch.testing.assert_close(s, x.sum())
    assert y.shape == (2, 0) and w.shape == (4, 0)
