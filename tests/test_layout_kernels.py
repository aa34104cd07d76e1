"""``ortrain.cpu.SplitLast`` / ``ConcatLast`` (``ortrain/runtime/layout_kernels.c``) and the
``cpu_split_concat`` pass.

- the kernels against numpy: ranks 1-4, one and many row blocks, ragged Concat widths,
  empty tensors; errors naming the op and shapes;
- the pass on a hand-built graph: what moves (equal splits, by count or by sizes; any
  last-axis Concat) and what stays (other axes, unequal sizes, int64), and the rewritten
  graph computes the original; GPT-2's QKV Split and its gradient's Concat in training.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper

from ortrain.core.names import CPU_DOMAIN
from ortrain.graph_passes.targets.cpu.split_concat import lower_split_concat
from tests.conftest import gpt2, lm_batches
from tests.test_forward_kernels import _run, _same_outputs, train_against_eager
from tests.test_grad_kernels import _f32, _library

F32, I64 = TensorProto.FLOAT, TensorProto.INT64


@pytest.mark.parametrize("parts", [1, 2, 3, 8])
@pytest.mark.parametrize("shape", [(24,), (5, 48), (2, 300, 96), (2, 3, 4, 2304)], ids=str)
def test_split_last_matches_numpy(shape: tuple[int, ...], parts: int) -> None:
    x = _f32(np.random.default_rng(parts), shape)
    got = _run("SplitLast", {"X": x}, [f"y{i}" for i in range(parts)])
    for g, w in zip(got, np.split(x, parts, axis=-1), strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("widths", [(3, 5), (768, 768, 768), (1, 64, 0, 7, 2, 2, 9, 16)], ids=str)
@pytest.mark.parametrize("lead", [(), (4,), (2, 300)], ids=str)
def test_concat_last_matches_numpy(lead: tuple[int, ...], widths: tuple[int, ...]) -> None:
    rng = np.random.default_rng(len(widths))
    xs = {f"x{i}": _f32(rng, (*lead, w)) for i, w in enumerate(widths)}
    (got,) = _run("ConcatLast", xs, ["y"])
    np.testing.assert_array_equal(got, np.concatenate(list(xs.values()), axis=-1))


def test_empty_rows() -> None:
    x = np.zeros((0, 6), np.float32)
    a, b = _run("SplitLast", {"X": x}, ["a", "b"])
    assert a.shape == b.shape == (0, 3)
    (y,) = _run("ConcatLast", {"a": x, "b": x}, ["y"])
    assert y.shape == (0, 12)


def test_errors_name_the_op_and_shapes() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(Exception, match=r"SplitLast: X \[4, 7\] does not split into 2 equal"):
        _run("SplitLast", {"X": _f32(rng, (4, 7))}, ["a", "b"])
    with pytest.raises(Exception, match=r"ConcatLast: input 1 is \[3, 5\], input 0 \[4, 5\]"):
        _run("ConcatLast", {"a": _f32(rng, (4, 5)), "b": _f32(rng, (3, 5))}, ["y"])


# --------------------------------------------------------------------------- the pass
def test_pass_moves_last_axis_copies() -> None:
    mk = helper.make_node
    sizes = helper.make_tensor("sizes", I64, [3], [4, 4, 4])
    uneven = helper.make_tensor("uneven", I64, [2], [5, 7])
    nodes = [
        mk("Split", ["x"], ["q", "k", "v"], axis=-1, num_outputs=3),  # moves
        mk("Split", ["x", "sizes"], ["s0", "s1", "s2"], axis=2),  # equal sizes: moves
        mk("Split", ["x", "uneven"], ["u0", "u1"], axis=-1),  # unequal: stays
        mk("Split", ["x"], ["h0", "h1"], axis=0, num_outputs=2),  # not the last axis
        mk("Concat", ["v", "q", "k", "q"], ["cat"], axis=-1),  # moves
        mk("Concat", ["x", "x"], ["cat0"], axis=0),  # stays
        mk("Concat", ["i", "i"], ["cati"], axis=-1),  # int64: stays
    ]
    inputs = [helper.make_tensor_value_info("x", F32, [4, 3, 12]),
              helper.make_tensor_value_info("i", I64, [5])]  # fmt: skip
    names = ["q", "k", "v", "s0", "s2", "u0", "u1", "h1", "cat", "cat0", "cati"]
    outputs = [helper.make_tensor_value_info(n, I64 if n == "cati" else F32, None) for n in names]
    graph = helper.make_graph(nodes, "g", inputs, outputs, [sizes, uneven])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    proto = onnx.shape_inference.infer_shapes(proto)
    model = ir.serde.deserialize_model(proto)
    assert lower_split_concat(model) == 3
    ops = [(n.domain, n.op_type) for n in model.graph]
    assert ops.count((CPU_DOMAIN, "SplitLast")) == 2 and ops.count((CPU_DOMAIN, "ConcatLast")) == 1
    assert ops.count(("", "Split")) == 2 and ops.count(("", "Concat")) == 2
    assert all(len(n.inputs) == 1 for n in model.graph if n.op_type == "SplitLast")
    rng = np.random.default_rng(1)
    feeds = {"x": _f32(rng, (4, 3, 12)), "i": np.arange(5, dtype=np.int64)}
    _same_outputs(proto, model, feeds)


@pytest.mark.slow
def test_gpt2_qkv_copies_move_and_train_like_eager() -> None:
    _library()
    model = gpt2(layers=2, hidden=64, vocab=128)
    batches = lm_batches(3, vocab=128)
    trainer = train_against_eager(model, batches, torch.optim.SGD, lr=0.5, momentum=0.9)
    graph = trainer.train_graphs[0].graph
    ops = [(n.domain, n.op_type) for n in graph]
    # per layer: the QKV Split forward and its gradients' Concat backward
    assert ops.count((CPU_DOMAIN, "SplitLast")) == 2 and ops.count((CPU_DOMAIN, "ConcatLast")) == 2
    assert ("", "Split") not in ops
