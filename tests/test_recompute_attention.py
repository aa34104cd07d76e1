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


def _shared_product_graph() -> ir.Model:
    """Two attentions over one product (the exporter's or CSE's: ``S = Q @ KT`` once), each
    with its own mask: P1 = Softmax(S + m1), P2 = Softmax(S + m2), both read backward."""
    q, kt, m1, m2, g = (_v(n, d) for n, d in [("Q", [2, 3, 4]), ("KT", [2, 4, 3]),
                        ("m1", [2, 1, 3]), ("m2", [1, 1, 3]), ("g", [2, 3, 3])])  # fmt: skip
    nodes: list[ir.Node] = []

    def add(op, inputs, out, backward=False, **attrs):
        meta = {GRAD_OF: "x"} if backward else {}
        attributes = [ir.AttrInt64(k, a) for k, a in attrs.items()]
        name = f"node_{out.name}"
        nodes.append(ir.Node("", op, inputs, attributes, outputs=[out], name=name,
                             metadata_props=meta))  # fmt: skip
        return out

    s = add("MatMul", [q, kt], _v("S", [2, 3, 3]))
    outs = []
    for i, m in enumerate((m1, m2)):
        a = add("Add", [s, m], _v(f"A{i}", [2, 3, 3]))
        p = add("Softmax", [a], _v(f"P{i}", [2, 3, 3]), axis=-1)
        outs.append(add("Mul", [p, g], _v(f"dP{i}", [2, 3, 3]), backward=True))
    outs.append(add("Mul", [q, q], _v("dQ", [2, 3, 4]), backward=True))
    outs.append(add("Mul", [kt, kt], _v("dK", [2, 4, 3]), backward=True))
    graph = ir.Graph([q, kt, m1, m2, g], outs, nodes=nodes, opset_imports={"": 18})
    return ir.Model(graph, ir_version=9)


def test_a_product_two_attentions_share_is_copied_once_for_each_under_its_own_name() -> None:
    """Each copy of the shared product has a name of its own: the same name twice made the
    graph invalid (ONNX values are named once; a model with two scaled-dot-product
    attentions over one Q and K stopped its build)."""
    model = _shared_product_graph()
    rng = np.random.default_rng(1)
    feeds = {v.name: rng.standard_normal(v.shape.dims).astype(np.float32)
             for v in model.graph.inputs}  # fmt: skip
    want = _run(model, feeds)
    assert recompute_attention_probs(model) == 2
    copies = [n for n in model.graph if RECOMPUTE_OF in n.metadata_props]
    assert [n.op_type for n in copies].count("MatMul") == 2
    names = [v.name for n in model.graph for v in n.outputs]
    assert len(names) == len(set(names)) and len({n.name for n in model.graph}) == len(names)
    proto = ir.serde.serialize_model(model)
    ir.serde.deserialize_model(proto)  # raised on the name declared twice
    for got, w in zip(_run(model, feeds), want, strict=True):
        np.testing.assert_array_equal(got, w)


def test_two_attentions_over_one_query_and_key_train_like_eager() -> None:
    """End to end: a float-bias and a causal ``scaled_dot_product_attention`` over one
    Q and K compile as one graph and train as eager."""
    import torch
    import torch.nn.functional as tf

    from tests.test_fallback import train_like_eager

    class _TwoAttentions(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.qkv = torch.nn.Linear(32, 96)
            self.out = torch.nn.Linear(32, 5)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            bias = torch.linspace(-1, 1, t * t).view(1, 1, t, t)
            q, k, v = self.qkv(x).view(b, t, 3, 4, 8).permute(2, 0, 3, 1, 4)
            a = tf.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            a = a + tf.scaled_dot_product_attention(q, k, v, is_causal=True)
            logits = self.out(a.transpose(1, 2).reshape(b, t, 32))
            return tf.cross_entropy(logits.flatten(0, 1), y.flatten())

    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(2, 6, 32, generator=g), torch.randint(0, 5, (2, 6), generator=g))
               for _ in range(3)]  # fmt: skip
    trainer = train_like_eager(_TwoAttentions, batches)
    assert trainer.segments is None  # one graph, not segments around a failed build
