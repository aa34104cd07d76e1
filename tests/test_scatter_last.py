"""``ortrain.cpu.ScatterLast`` / ``ScatterAddLast`` (``ortrain/runtime/layout_kernels.c``)
and the ``cpu_scatter_last`` pass.

- the kernels against numpy: ranks 1-3, repeated and negative indices ("add" sums the
  repeats in index order), errors naming the op, the index and the shapes;
- the pass on a hand-built graph: what moves (reduction none / add along the last axis,
  float32), what stays (another axis, "mul", float16), the output's shape stated (ONNX
  Runtime hands a custom op's output its input's buffer only then), the rewritten graph
  computing the original; the cross-entropy gradient of GPT-2 on the kernel in training.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ortrain.core.names import CPU_DOMAIN
from ortrain.graph_passes.targets.cpu.scatter_last import lower_scatter_last
from tests.conftest import gpt2, lm_batches
from tests.test_forward_kernels import train_against_eager
from tests.test_grad_kernels import _library

F32, F16, I64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT64


def _session(proto: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.register_custom_ops_library(_library())
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _scatter(op: str, data: np.ndarray, idx: np.ndarray, upd: np.ndarray) -> np.ndarray:
    vis = [
        helper.make_tensor_value_info("data", F32, None),
        helper.make_tensor_value_info("idx", I64, None),
        helper.make_tensor_value_info("upd", F32, None),
    ]
    node = helper.make_node(op, ["data", "idx", "upd"], ["out"], domain=CPU_DOMAIN)
    out = [helper.make_tensor_value_info("out", F32, None)]
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(CPU_DOMAIN, 1)]
    proto = helper.make_model(helper.make_graph([node], "g", vis, out), opset_imports=opsets)
    return _session(proto).run(None, {"data": data, "idx": idx, "upd": upd})[0]


def _numpy(data: np.ndarray, idx: np.ndarray, upd: np.ndarray, add: bool) -> np.ndarray:
    out = data.copy().reshape(-1, data.shape[-1])
    n = data.shape[-1]
    for row, (cols, vals) in enumerate(
        zip(idx.reshape(-1, idx.shape[-1]), upd.reshape(-1, idx.shape[-1]), strict=True)
    ):
        for c, v in zip(cols, vals, strict=True):
            c = c + n if c < 0 else c
            out[row, c] = out[row, c] + v if add else v
    return out.reshape(data.shape)


@pytest.mark.parametrize("op", ["ScatterLast", "ScatterAddLast"])
@pytest.mark.parametrize(("shape", "per_row"), [((9,), 3), ((6, 50), 1), ((2, 5, 300), 4)])
def test_scatter_last_matches_numpy(op: str, shape: tuple[int, ...], per_row: int) -> None:
    rng = np.random.default_rng(len(shape) + per_row)
    data = rng.standard_normal(shape).astype(np.float32)
    n = shape[-1]
    idx = rng.integers(-n, n, size=(*shape[:-1], per_row)).astype(np.int64)
    if per_row > 1 and op == "ScatterAddLast":
        idx[..., 1] = idx[..., 0]  # a repeated index: "add" sums both
    if op == "ScatterLast":  # distinct per row: "none" with repeats has no defined order
        idx = np.stack([rng.permutation(n)[:per_row] for _ in range(idx.size // per_row)])
        idx = idx.reshape(*shape[:-1], per_row).astype(np.int64) - n  # negative as well
    upd = rng.standard_normal(idx.shape).astype(np.float32)
    got = _scatter(op, data, idx, upd)
    np.testing.assert_array_equal(got, _numpy(data, idx, upd, op == "ScatterAddLast"))


def test_scatter_last_errors_name_the_op_index_and_shapes() -> None:
    data = np.zeros((4, 5), np.float32)
    with pytest.raises(Exception, match=r"ScatterAddLast: index 5 \(entry 2\) is out of range"):
        _scatter(
            "ScatterAddLast", data, np.array([[0], [1], [5], [2]]), np.ones((4, 1), np.float32)
        )
    with pytest.raises(Exception, match=r"ScatterLast: indices \[3, 1\] must match data \[4, 5\]"):
        _scatter("ScatterLast", data, np.zeros((3, 1), np.int64), np.ones((3, 1), np.float32))


def _graph(axis: int, reduction: str | None, dtype: int = F32) -> onnx.ModelProto:
    attrs = {"axis": axis} | ({"reduction": reduction} if reduction else {})
    nodes = [
        helper.make_node("Softmax", ["x"], ["p"], axis=-1),
        helper.make_node("ScatterElements", ["p", "idx", "upd"], ["out"], **attrs),
    ]
    vis = [
        helper.make_tensor_value_info("x", dtype, [6, 40]),
        helper.make_tensor_value_info("idx", I64, [6, 1]),
        helper.make_tensor_value_info("upd", dtype, [6, 1]),
    ]
    out = [helper.make_tensor_value_info("out", dtype, None)]
    return helper.make_model(
        helper.make_graph(nodes, "g", vis, out), opset_imports=[helper.make_opsetid("", 18)]
    )


@pytest.mark.parametrize(
    ("axis", "reduction", "dtype", "want"),
    [
        (1, "add", F32, "ScatterAddLast"),
        (-1, None, F32, "ScatterLast"),
        (1, "none", F32, "ScatterLast"),
        (0, "add", F32, None),  # not the last axis
        (1, "mul", F32, None),
        (1, "add", F16, None),
    ],
)
def test_pass_moves_last_axis_scatters_and_states_the_shape(
    axis: int, reduction: str | None, dtype: int, want: str | None
) -> None:
    proto = onnx.shape_inference.infer_shapes(_graph(axis, reduction, dtype))
    model = ir.serde.deserialize_model(proto)
    assert lower_scatter_last(model) == (1 if want else 0)
    (node,) = [n for n in model.graph if n.op_type != "Softmax"]
    assert node.op_type == (want or "ScatterElements")
    if want is None:
        return
    assert node.domain == CPU_DOMAIN and not node.attributes
    assert node.outputs[0].shape == ir.Shape([6, 40]) and node.outputs[0].dtype == ir.DataType.FLOAT
    rng = np.random.default_rng(0)
    feeds = {
        "x": rng.standard_normal((6, 40)).astype(np.float32),
        "idx": rng.integers(0, 40, (6, 1)).astype(np.int64),
        "upd": rng.standard_normal((6, 1)).astype(np.float32),
    }
    want_out = _session(proto).run(None, feeds)[0]
    got = _session(ir.serde.serialize_model(model)).run(None, feeds)[0]
    np.testing.assert_array_equal(got, want_out)


@pytest.mark.slow
def test_gpt2_cross_entropy_gradient_on_the_kernel() -> None:
    _library()
    model = gpt2(layers=2, hidden=64, vocab=128)
    trainer = train_against_eager(model, lm_batches(3, vocab=128), torch.optim.SGD, lr=0.5,
                                  momentum=0.9)  # fmt: skip
    ops = [n.op_type for n in trainer.train_graphs[0].graph]
    assert ops.count("ScatterAddLast") == 1 and "ScatterElements" not in ops
