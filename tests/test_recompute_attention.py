"""``graph_passes/memory/recompute_attention.py`` on hand-built graphs: the probabilities' chain
(product, mask, Softmax) copied before their first backward reader, which reads the copy,
outputs bit-identical; what stays (a product's output the backward reads itself, a mask
as large as the probabilities made in the forward, a product of a value the backward does
not keep). GPT-2 end to end: ``tests/test_memory_plan.py`` (copies, kept bytes, outputs
bit-identical with the pass on and off) and the trainers' tests that run it by default."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from ortrain.graph_passes.infra.tags import GRAD_OF, RECOMPUTE_OF
from ortrain.graph_passes.memory.recompute_attention import recompute_attention_probs

F = ir.DataType.FLOAT


def _v(name: str, dims: list[int]) -> ir.Value:
    return ir.Value(name=name, shape=ir.Shape(dims), type=ir.TensorType(F))


def _graph(mask_dims: list[int], backward_reads_scores: bool = False, q_kept: bool = True):
    """P = Softmax(Q @ KT + Neg(m)); out = P @ V; "backward": dP = P * g (and S * g)."""
    q, kt, v, m, g = _v("Q", [2, 3, 4]), _v("KT", [2, 4, 3]), _v("V", [2, 3, 4]), _v(
        "m", mask_dims), _v("g", [2, 3, 3])  # fmt: skip
    nodes: list[ir.Node] = []

    def add(op: str, inputs: list[ir.Value], out: ir.Value, backward: bool = False, **attrs):
        meta = {GRAD_OF: "x"} if backward else {}
        attributes = [
            ir.AttrInt64s(k, a) if isinstance(a, list) else ir.AttrInt64(k, a)
            for k, a in attrs.items()
        ]
        nodes.append(ir.Node("", op, inputs, attributes, outputs=[out], name=out.name,
                             metadata_props=meta))  # fmt: skip
        return out

    qq = q if q_kept else add("Relu", [q], _v("Qr", [2, 3, 4]))
    s = add("MatMul", [qq, kt], _v("S", [2, 3, 3]))
    mask = add("Neg", [m], _v("mask", mask_dims))
    a = add("Add", [s, mask], _v("A", [2, 3, 3]))
    p = add("Softmax", [a], _v("P", [2, 3, 3]), axis=-1)
    out = add("MatMul", [p, v], _v("out", [2, 3, 4]))
    dp = add("Mul", [p, g], _v("dP", [2, 3, 3]), backward=True)
    k = add("Transpose", [kt], _v("K", [2, 3, 4]), backward=True, perm=[0, 2, 1])
    dq = add("MatMul", [dp, k], _v("dQ", [2, 3, 4]), backward=True)
    outs = [out, dp, dq]
    if backward_reads_scores:
        outs.append(add("Mul", [s, g], _v("dS", [2, 3, 3]), backward=True))
    if q_kept:
        outs.append(add("Mul", [qq, qq], _v("dK", [2, 3, 4]), backward=True))
    graph = ir.Graph([q, kt, v, m, g], outs, nodes=nodes, opset_imports={"": 18})
    return ir.Model(graph, ir_version=9)


def _run(model: ir.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    data = ir.serde.serialize_model(model).SerializeToString()
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)


def _feeds(mask_dims: list[int]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    dims = {"Q": [2, 3, 4], "KT": [2, 4, 3], "V": [2, 3, 4], "m": mask_dims, "g": [2, 3, 3]}
    return {k: rng.standard_normal(d).astype(np.float32) for k, d in dims.items()}


def test_probabilities_made_again_before_their_backward() -> None:
    model = _graph([2, 1, 3])  # a mask broadcast over the rows: a sixth of P
    want = _run(model, _feeds([2, 1, 3]))
    assert recompute_attention_probs(model) == 1
    order = list(model.graph)
    copies = [n for n in order if RECOMPUTE_OF in n.metadata_props]
    assert [n.op_type for n in copies] == ["MatMul", "Add", "Softmax"]
    assert all(n.metadata_props[GRAD_OF] == "x" for n in copies)
    (dp,) = [n for n in order if n.name == "dP"]
    assert dp.inputs[0] is copies[-1].outputs[0] and order.index(copies[-1]) < order.index(dp)
    (fwd,) = [n for n in order if n.name == "out"]
    assert fwd.inputs[0].name == "P"  # the forward still reads its own
    assert copies[1].inputs[1].name == "mask"  # the mask itself, kept into the backward
    for got, w in zip(_run(model, _feeds([2, 1, 3])), want, strict=True):
        np.testing.assert_array_equal(got, w)


def test_what_stays() -> None:
    for model in (
        _graph([2, 1, 3], backward_reads_scores=True),  # the scores are kept anyway
        _graph([2, 3, 3]),  # a forward-made mask as large as P
        _graph([2, 1, 3], q_kept=False),  # Q is not kept: copying would keep it
    ):
        before = [n.name for n in model.graph]
        assert recompute_attention_probs(model) == 0
        assert [n.name for n in model.graph] == before
