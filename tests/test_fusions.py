"""Training-graph fusions (graph_passes/fusions/) and the backward cleanup.

1. Each pass on tiny hand-built graphs: the count it returns, the ops that remain, the
   outputs before/after (ONNX Runtime), and the cases it must leave alone.
2. Each pass inside the training build of exported GPT-2 and BERT-MLM (and a module with
   a hand-written LayerNorm): loss and every parameter gradient before vs after the pass,
   element-wise (gradcheck.assert_close: rtol 1e-5, atol 1e-5 x max|reference|).
3. Structure after the proposed pipeline (``training_fusions()``): no decomposed GELU or
   LayerNorm chains, no foldable Transpose feeding a product, the fused-op counts.

Sessions run on one thread, so "before" and "after" sum in the same order.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from ortrain.export import export_forward
from ortrain.graph_passes.autodiff import GradientError, build_gradient_graph
from ortrain.graph_passes.cleanup.backward_cleanup import (
    clean_backward,
    eliminate_common_subexpressions,
    fold_constants,
    merge_gradient_sums,
    remove_dead_gradient_nodes,
    scatter_into_sums,
)
from ortrain.graph_passes.cleanup.fold_transpose_gemm import fold_transposes
from ortrain.graph_passes.fusions import FUSIONS, training_fusions
from ortrain.graph_passes.fusions.bias_gelu import fuse_bias_gelu
from ortrain.graph_passes.fusions.layer_norm import fuse_layer_norm
from ortrain.graph_passes.fusions.matmul_add import fuse_matmul_add
from ortrain.graph_passes.fusions.matmul_transpose import fuse_matmul_transpose
from ortrain.graph_passes.fusions.sink_row_scale import sink_row_scales
from ortrain.graph_passes.fusions.skip_layer_norm import fuse_skip_layer_norm
from ortrain.graph_passes.infra.pipeline import run_pipeline
from ortrain.graph_passes.infra.tags import GRAD_OF
from ortrain.graph_passes.training_pipeline import (
    BuildConfig,
    BuildInputs,
    BuildProducts,
    build_pipeline,
)
from tests.conftest import bert_batches, bert_mlm, gpt2, lm_batches
from tests.gradcheck import TinyGraph, assert_close

MS = "com.microsoft"
OPSETS = {"": 20, MS: 1}
FLOAT = ir.DataType.FLOAT


# --- helpers -----------------------------------------------------------------------------


def _session(model: ir.Model) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    data = ir.serde.serialize_model(model).SerializeToString()
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def _run(model: ir.Model, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = _session(model)
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()}
    return dict(zip(names, sess.run(names, {k: v for k, v in feeds.items() if k in wanted})))


def _ops(model: ir.Model) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph)


def _feeds(model: ir.Model, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        v.name: rng.standard_normal([int(d) for d in v.shape.dims]).astype(np.float32)
        for v in model.graph.inputs
    }


def _check_pass(
    build: Callable[[], ir.Model], fuse: Callable[[ir.Model], int], count: int
) -> ir.Model:
    """Apply ``fuse`` to a fresh graph: returns ``count``, keeps outputs, then is a no-op."""
    model = build()
    feeds = _feeds(model)
    before = _run(model, feeds)
    assert fuse(model) == count
    after = _run(model, feeds)
    assert after.keys() == before.keys()
    for k in before:
        assert_close(after[k], before[k], k)
    assert fuse(model) == 0
    return model


def _copy(model: ir.Model) -> ir.Model:
    return ir.serde.deserialize_model(ir.serde.serialize_model(model))


# --- 1. hand-built graphs: layer norm ------------------------------------------------------


def _decomposed_ln(
    *, bias: bool = True, square: str = "Pow", norm: str = "Div", scale_first: bool = False,
    scale_shape: tuple[int, ...] = (8,), axes: int = -1,
) -> ir.Model:  # fmt: skip
    g = TinyGraph()
    s = (2, 3, 8)
    x = g.input("x", s)
    scale = g.input("scale", scale_shape)
    stat = (2, 3, 1) if axes in (-1, 2) else (2, 1, 8)
    mean = g.op("ReduceMean", x, g.const("axes", np.array([axes])), name="mean", shape=stat,
                keepdims=1)  # fmt: skip
    d = g.op("Sub", x, mean, name="d", shape=s)
    if square == "Pow":
        sq = g.op("Pow", d, g.const("two", np.float32(2.0)), name="sq", shape=s)
    else:
        sq = g.op("Mul", d, d, name="sq", shape=s)
    var = g.op("ReduceMean", sq, g.const("axes2", np.array([axes])), name="var", shape=stat,
               keepdims=1)  # fmt: skip
    std = g.op("Sqrt", g.op("Add", var, g.const("eps", np.float32(1e-5)), name="ve", shape=stat),
               name="std", shape=stat)  # fmt: skip
    if norm == "Div":
        n = g.op("Div", d, std, name="n", shape=s)
    else:
        n = g.op("Mul", d, g.op("Reciprocal", std, name="r", shape=stat), name="n", shape=s)
    y = g.op("Mul", *((scale, n) if scale_first else (n, scale)), name="y", shape=s)
    if bias:
        y = g.op("Add", g.input("bias", (8,)), y, name="yb", shape=s)
    return g.model(y)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"bias": False, "square": "Mul", "norm": "Reciprocal"},
        {"scale_first": True, "axes": 2},
    ],
    ids=["pow-div-bias", "mul-reciprocal-nobias", "commuted-axes2"],
)
def test_layer_norm_fuses_decomposed_chain(kw):
    model = _check_pass(lambda: _decomposed_ln(**kw), fuse_layer_norm, 1)
    assert _ops(model) == collections.Counter({"LayerNormalization": 1})
    (node,) = model.graph
    assert len(node.inputs) == (3 if kw.get("bias", True) else 2)
    assert node.attributes["epsilon"].value == pytest.approx(1e-5)


@pytest.mark.parametrize(
    "kw", [{"scale_shape": (2, 3, 8)}, {"axes": 1}], ids=["scale-not-1d", "other-axis"]
)
def test_layer_norm_leaves_other_normalizations(kw):
    model = _decomposed_ln(**kw)
    assert fuse_layer_norm(model) == 0
    assert "LayerNormalization" not in _ops(model)


# --- 1. hand-built graphs: Transpose / scale into FusedMatMul ------------------------------


def test_matmul_transpose_linear_weight():
    def build():  # torch nn.Linear: x @ W^T
        g = TinyGraph()
        x, w = g.input("x", (2, 3, 4)), g.input("w", (5, 4))
        wt = g.op("Transpose", w, name="wt", shape=(4, 5), perm=[1, 0])
        return g.model(g.op("MatMul", x, wt, name="mm", shape=(2, 3, 5)))

    model = _check_pass(build, fuse_matmul_transpose, 1)
    assert _ops(model) == collections.Counter({"FusedMatMul": 1})
    (node,) = model.graph
    assert node.attributes["transB"].value == 1 and [v.name for v in node.inputs] == ["x", "w"]


def test_matmul_transpose_attention_scores():
    # scores = (q @ Transpose(k, [0, 2, 3, 1])) * 0.125: K^T = head permutation + swap.
    def build():
        g = TinyGraph()
        q, k = g.input("q", (2, 4, 3, 8)), g.input("k", (2, 3, 4, 8))
        kt = g.op("Transpose", k, name="kt", shape=(2, 4, 8, 3), perm=[0, 2, 3, 1])
        s = g.op("MatMul", q, kt, name="qk", shape=(2, 4, 3, 3))
        return g.model(
            g.op("Mul", s, g.const("c", np.float32(0.125)), name="s", shape=(2, 4, 3, 3))
        )

    model = _check_pass(build, fuse_matmul_transpose, 2)  # the K^T, then the scale
    assert _ops(model) == collections.Counter({"Transpose": 1, "FusedMatMul": 1})
    t, mm = model.graph
    assert list(t.attributes["perm"].value) == [0, 2, 1, 3]
    assert mm.attributes["transB"].value == 1
    assert mm.attributes["alpha"].value == pytest.approx(0.125)


def test_matmul_transpose_divided_product_and_transposed_a():
    def build():
        g = TinyGraph()
        a, b = g.input("a", (2, 4, 3)), g.input("b", (2, 4, 5))
        at = g.op("Transpose", a, name="at", shape=(2, 3, 4), perm=[0, 2, 1])
        mm = g.op("MatMul", at, b, name="mm", shape=(2, 3, 5))
        return g.model(g.op("Div", mm, g.const("c", np.float32(4.0)), name="d", shape=(2, 3, 5)))

    model = _check_pass(build, fuse_matmul_transpose, 2)
    (node,) = model.graph
    assert node.op_type == "FusedMatMul" and node.attributes["transA"].value == 1
    assert node.attributes["alpha"].value == pytest.approx(0.25)


def test_matmul_transpose_keeps_head_permutation_and_shared_transpose():
    g = TinyGraph()
    v, p = g.input("v", (2, 3, 4, 8)), g.input("p", (2, 4, 3, 3))
    vt = g.op("Transpose", v, name="vt", shape=(2, 4, 3, 8), perm=[0, 2, 1, 3])
    ctx = g.op("MatMul", p, vt, name="ctx", shape=(2, 4, 3, 8))
    w = g.input("w", (5, 8))
    wt = g.op("Transpose", w, name="wt", shape=(8, 5), perm=[1, 0])
    y = g.op("MatMul", ctx, wt, name="y", shape=(2, 4, 3, 5))
    model = g.model(y, wt)  # the transposed weight is also an output: read elsewhere
    assert fuse_matmul_transpose(model) == 0
    assert _ops(model) == collections.Counter({"Transpose": 2, "MatMul": 2})


def test_matmul_transpose_keeps_a_transposed_matrix_times_a_vector():
    """W.T @ v (spectral_norm's power iteration): ONNX Runtime's FusedMatMul ignores transA
    when B is 1-D, so folding the Transpose would compute W @ v's numbers in W.T @ v's
    shape (tests/test_rules_coverage.py checks that ONNX Runtime still does)."""
    g = TinyGraph()
    w, v = g.input("w", (5, 8)), g.input("v", (5,))
    wt = g.op("Transpose", w, name="wt", shape=(8, 5), perm=[1, 0])
    model = g.model(g.op("MatMul", wt, v, name="mv", shape=(8,)))
    assert fuse_matmul_transpose(model) == 0
    assert _ops(model) == collections.Counter({"Transpose": 1, "MatMul": 1})


def test_fused_matmul_rule_rejects_trans_batch_which_no_fusion_emits():
    g = TinyGraph()
    a, b = g.input("a", (3, 2, 4)), g.input("b", (2, 4, 5))
    y = g.op("FusedMatMul", a, b, name="fmm", shape=(2, 2, 5), domain=MS, transBatchA=1)
    loss = g.op("ReduceSum", y, name="loss", shape=(), keepdims=0)
    with pytest.raises(GradientError, match="transBatch"):
        build_gradient_graph(g.model(loss), loss.name, ["a"])


# --- 1. hand-built graphs: MatMul + Add into Gemm ------------------------------------------


def _linear(x_shape: tuple[int, ...], bias_shape: tuple[int, ...], fused: bool) -> ir.Model:
    g = TinyGraph()
    x = g.input("x", x_shape)
    out = (*x_shape[:-1], 5)
    if fused:
        w = g.input("w", (5, x_shape[-1]))
        mm = g.op("FusedMatMul", x, w, name="mm", shape=out, domain=MS, transB=1, alpha=0.5)
    else:
        w = g.input("w", (x_shape[-1], 5))
        mm = g.op("MatMul", x, w, name="mm", shape=out)
    return g.model(g.op("Add", g.input("b", bias_shape), mm, name="y", shape=out))


@pytest.mark.parametrize(
    "x_shape,bias_shape,fused,ops",
    [
        ((3, 4), (5,), False, {"Gemm": 1}),
        ((3, 4), (3, 5), True, {"Gemm": 1}),
        ((2, 3, 4), (5,), True, {"Reshape": 2, "Gemm": 1}),
        ((2, 3, 4), (1, 1, 5), False, {"Reshape": 3, "Gemm": 1}),
    ],
    ids=["2d", "2d-fused-full-bias", "3d-fused-linear", "3d-bias-1x1xN"],
)
def test_matmul_add_to_gemm(x_shape, bias_shape, fused, ops):
    model = _check_pass(lambda: _linear(x_shape, bias_shape, fused), fuse_matmul_add, 1)
    assert _ops(model) == collections.Counter(ops)
    gemm = next(n for n in model.graph if n.op_type == "Gemm")
    assert gemm.attributes["transB"].value == int(fused)
    assert gemm.attributes["alpha"].value == (0.5 if fused else 1.0)


def test_matmul_add_keeps_row_varying_bias_and_shared_product():
    model = _linear((2, 3, 4), (3, 5), False)  # bias varies along the rows of [2, 3, 5]
    assert fuse_matmul_add(model) == 0
    g = TinyGraph()
    x, w, b = g.input("x", (3, 4)), g.input("w", (4, 5)), g.input("b", (5,))
    mm = g.op("MatMul", x, w, name="mm", shape=(3, 5))
    shared = g.model(g.op("Add", mm, b, name="y", shape=(3, 5)), mm)
    assert fuse_matmul_add(shared) == 0


# --- 1. hand-built graphs: bias + GELU ------------------------------------------------------


def _bias_gelu(approximate: str, bias_shape=(8,), commuted=False, shared=False) -> ir.Model:
    g = TinyGraph()
    x, b = g.input("x", (2, 3, 8)), g.input("b", bias_shape)
    t = g.op("Add", *((b, x) if commuted else (x, b)), name="t", shape=(2, 3, 8))
    y = g.op("Gelu", t, name="y", shape=(2, 3, 8), approximate=approximate)
    return g.model(y, t) if shared else g.model(y)


@pytest.mark.parametrize(
    "approximate,commuted,fused_op",
    [("none", False, "BiasGelu"), ("none", True, "BiasGelu"), ("tanh", True, "FastGelu")],
)
def test_bias_gelu(approximate, commuted, fused_op):
    model = _check_pass(lambda: _bias_gelu(approximate, commuted=commuted), fuse_bias_gelu, 1)
    assert _ops(model) == collections.Counter({fused_op: 1})
    (node,) = model.graph
    assert node.domain == MS and [v.name for v in node.inputs] == ["x", "b"]


@pytest.mark.parametrize(
    "kw", [{"bias_shape": (3, 8)}, {"shared": True}], ids=["bias-2d", "shared"]
)
def test_bias_gelu_kept(kw):
    model = _bias_gelu("none", **kw)
    assert fuse_bias_gelu(model) == 0 and _ops(model)["Gelu"] == 1


# --- 1. hand-built graphs: residual Add + LayerNorm -----------------------------------------


def _residual_ln(skip_shape=(2, 3, 8), sum_read=False) -> ir.Model:
    g = TinyGraph()
    x, skip = g.input("x", (2, 3, 8)), g.input("skip", skip_shape)
    gamma, beta = g.input("gamma", (8,)), g.input("beta", (8,))
    s = g.op("Add", x, skip, name="s", shape=(2, 3, 8))
    y = g.op("LayerNormalization", s, gamma, beta, name="ln", shape=(2, 3, 8), axis=-1,
             epsilon=1e-5, stash_type=1)  # fmt: skip
    if not sum_read:
        return g.model(y)
    z = g.op("Mul", s, y, name="next_residual", shape=(2, 3, 8))
    return g.model(z)


@pytest.mark.parametrize("sum_read", [False, True])
def test_skip_layer_norm(sum_read):
    model = _check_pass(lambda: _residual_ln(sum_read=sum_read), fuse_skip_layer_norm, 1)
    node = next(n for n in model.graph if n.op_type == "SkipLayerNormalization")
    assert _ops(model)["LayerNormalization"] == 0 and _ops(model)["Add"] == 0
    assert [o.name for o in node.outputs][1:3] == ["", ""]  # statistics: not computed
    assert bool(node.outputs[3].uses()) == sum_read


def test_skip_layer_norm_keeps_broadcast_skip():
    model = _residual_ln(skip_shape=(1, 3, 8))  # GPT-2's position embeddings
    assert fuse_skip_layer_norm(model) == 0 and _ops(model)["LayerNormalization"] == 1


# --- 1. hand-built graphs: backward cleanup -------------------------------------------------


def _grad(v: ir.Value) -> ir.Value:
    v.producer().metadata_props[GRAD_OF] = "forward_node"
    return v


def test_backward_cse_merges_gradient_nodes_only_and_never_dropouts():
    g = TinyGraph()
    x, y = g.input("x", (3, 4)), g.input("y", (3, 4))
    f1 = g.op("Mul", x, y, name="fwd1", shape=(3, 4))
    f2 = g.op("Mul", x, y, name="fwd2", shape=(3, 4))  # a forward duplicate: not ours
    b1 = _grad(g.op("Mul", f1, y, name="g1", shape=(3, 4)))
    b2 = _grad(g.op("Mul", f1, y, name="g2", shape=(3, 4)))
    ratio, train = g.const("ratio", np.float32(0.5)), g.const("train", np.bool_(True))
    d1 = _grad(g.op("Dropout", b1, ratio, train, name="drop1", shape=(3, 4)))
    d2 = _grad(g.op("Dropout", b1, ratio, train, name="drop2", shape=(3, 4)))
    z = g.op("Add", b2, d2, name="z", shape=(3, 4))
    model = g.model(f2, z, d1)
    assert eliminate_common_subexpressions(model) == 1
    ops = _ops(model)
    assert ops["Mul"] == 3 and ops["Dropout"] == 2
    assert model.graph.outputs[1].producer().inputs[0].producer().name == "g1"


def test_backward_constant_folding_respects_size_limit():
    g = TinyGraph()
    x = g.input("x", (3, 4))
    small = _grad(g.op("Neg", g.const("c", np.full((3, 4), 2.0, np.float32)), name="neg",
                       shape=(3, 4)))  # fmt: skip
    big = _grad(g.op("Expand", g.const("z", np.float32(0.0)), g.const("s", np.array([64, 64])),
                     name="zeros", shape=(64, 64)))  # fmt: skip
    y = g.op("Add", x, small, name="add", shape=(3, 4))
    model = g.model(y, big)
    feeds = _feeds(model)
    before = _run(model, feeds)
    assert fold_constants(model) == 1
    assert _ops(model) == collections.Counter({"Add": 1, "Expand": 1})
    assert_close(_run(model, feeds)["add_out"], before["add_out"], "add")


def test_fold_transposes_of_and_into_products():
    def build():
        g = TinyGraph()
        a, b, c = g.input("a", (2, 3, 4)), g.input("b", (2, 4, 5)), g.input("c", (3, 6))
        mm = _grad(g.op("MatMul", a, b, name="mm", shape=(2, 3, 5)))
        t = _grad(g.op("Transpose", mm, name="t", shape=(2, 5, 3), perm=[0, 2, 1]))
        ct = _grad(g.op("Transpose", c, name="ct", shape=(6, 3), perm=[1, 0]))
        w = g.input("w", (6, 7))
        gemm = _grad(g.op("Gemm", ct, w, name="gemm", shape=(3, 7), transA=1))
        return g.model(t, gemm)

    model = _check_pass(build, lambda m: fold_transposes(m, lambda n: GRAD_OF in n.metadata_props),
                        2)  # fmt: skip
    assert _ops(model) == collections.Counter({"FusedMatMul": 1, "Gemm": 1})
    gemm = next(n for n in model.graph if n.op_type == "Gemm")
    assert gemm.attributes["transA"].value == 0 and gemm.inputs[0].name == "c"


def test_backward_sums_merge_into_one():
    def build():
        g = TinyGraph()
        a, b, c, d = (g.input(n, (3, 4)) for n in "abcd")
        s1 = _grad(g.op("Add", a, b, name="s1", shape=(3, 4)))
        s2 = _grad(g.op("Sum", s1, c, name="s2", shape=(3, 4)))
        return g.model(_grad(g.op("Sum", s2, d, name="s3", shape=(3, 4))))

    model = _check_pass(build, merge_gradient_sums, 2)
    (node,) = model.graph
    assert node.op_type == "Sum" and [v.name for v in node.inputs] == ["a", "b", "c", "d"]


def _embedding_grad_sum(table: str, terms: int) -> ir.Model:
    """Sum(dense terms..., ScatterElements(table, rows, updates, add)): rows repeat."""
    g = TinyGraph()
    dense = [g.input(f"d{i}", (6, 4)) for i in range(terms)]
    updates = g.input("u", (5, 4))
    rows = g.const("rows", np.repeat(np.array([[1], [4], [1], [0], [4]]), 4, axis=1))
    if table == "zeros":
        zero, shape = g.const("zero", np.float32(0.0)), g.const("shape", np.array([6, 4]))
        base = _grad(g.op("Expand", zero, shape, name="zeros", shape=(6, 4)))
    else:
        base = g.input("t", (6, 4))
    scattered = _grad(g.op("ScatterElements", base, rows, updates, name="scatter", shape=(6, 4),
                           axis=0, reduction="add"))  # fmt: skip
    return g.model(_grad(g.op("Sum", *dense, scattered, name="sum", shape=(6, 4))))


@pytest.mark.parametrize("terms", [1, 2])
def test_embedding_gradient_scatters_into_the_sum(terms):
    model = _check_pass(lambda: _embedding_grad_sum("zeros", terms), scatter_into_sums, 1)
    remove_dead_gradient_nodes(model)
    ops = _ops(model)
    assert ops["ScatterElements"] == 1 and ops["Expand"] == 0
    assert ops["Sum"] == (1 if terms == 2 else 0)
    (scatter,) = (n for n in model.graph if n.op_type == "ScatterElements")
    assert scatter.outputs[0] is model.graph.outputs[0]  # the gradient itself, no Sum after it


def test_scatter_into_a_nonzero_table_is_left_alone():
    model = _embedding_grad_sum("input", 1)
    assert scatter_into_sums(model) == 0


def test_clean_backward_leaves_forward_alone():
    g = TinyGraph()
    x = g.input("x", (3, 4))
    f1 = g.op("Tanh", x, name="t1", shape=(3, 4))
    f2 = g.op("Tanh", x, name="t2", shape=(3, 4))
    model = g.model(f1, f2)
    assert clean_backward(model) == 0 and _ops(model)["Tanh"] == 2


# --- 1. hand-built graphs: a row scale moved off the wide operand ---------------------------

# (operand index of the scaled value, transA, transB) -> shape of the other operand
_ROW_SCALE_GEMMS = {
    (0, 0, 0): (40, 3), (0, 0, 1): (3, 40), (0, 1, 0): (6, 3), (0, 1, 1): (3, 6),
    (1, 0, 0): (3, 6), (1, 1, 0): (6, 3), (1, 0, 1): (3, 40), (1, 1, 1): (40, 3),
}  # fmt: skip


def _row_scaled(readers, *, scale_shape=(6, 1), width: int = 40, reader: str = "Gemm",
                tag: bool = True, reshape: bool = True) -> ir.Model:  # fmt: skip
    """Mul(Exp(x), c) [6, width] (through Reshapes to [2, 3, width] and back) read by Gemms."""
    g = TinyGraph()
    x = _grad(g.op("Exp", g.input("x", (6, width)), name="exp", shape=(6, width)))
    c = g.input("c", scale_shape)
    y = g.op("Mul", x, c, name="scale", shape=(6, width))
    if tag:
        _grad(y)
    if reshape:
        y3 = _grad(g.op("Reshape", y, g.const("s3", np.array([2, 3, width])), name="r3",
                        shape=(2, 3, width)))  # fmt: skip
        y = _grad(g.op("Reshape", y3, g.const("s2", np.array([6, width])), name="r2",
                       shape=(6, width)))  # fmt: skip
    outs = []
    for k, (idx, ta, tb) in enumerate(readers):
        other = g.input(f"w{k}", _ROW_SCALE_GEMMS[(idx, ta, tb)])
        a_rows = other.shape[1] if idx == 1 and ta else other.shape[0]
        rows = (width if ta else 6) if idx == 0 else a_rows
        cols = (other.shape[0] if tb else other.shape[1]) if idx == 0 else (6 if tb else width)
        ins = [y, other] if idx == 0 else [other, y]
        if reader == "Gemm+C":
            ins.append(g.input(f"bias{k}", (rows, cols)))
        op = "ReduceSum" if reader == "ReduceSum" else "Gemm"
        attrs = {} if op == "ReduceSum" else {"transA": ta, "transB": tb}
        outs.append(_grad(g.op(op, *ins, name=f"gemm{k}", shape=(rows, cols), **attrs)))
    return g.model(*outs)


def _wide_muls(model: ir.Model, width: int = 40) -> int:
    wide = [n for n in model.graph if n.op_type == "Mul" and n.outputs[0].shape is not None]
    return sum(1 for n in wide if width in n.outputs[0].shape.dims)


@pytest.mark.parametrize("case", list(_ROW_SCALE_GEMMS))
def test_row_scale_moves_to_the_narrow_side(case):
    model = _check_pass(lambda: _row_scaled([case]), sink_row_scales, 1)
    ops = _ops(model)
    assert _wide_muls(model) == 0 and ops["Mul"] == 1 and ops["Gemm"] == 1
    (gemm,) = (n for n in model.graph if n.op_type == "Gemm")
    assert [gemm.attributes[k].value for k in ("transA", "transB")] == list(case[1:])
    assert all(n.metadata_props.get(GRAD_OF) for n in model.graph)  # still backward nodes


def test_row_scale_of_the_cross_entropy_gradient_shape():
    """Two readers, like the LM head's input and weight gradients."""
    model = _check_pass(lambda: _row_scaled([(0, 0, 0), (0, 1, 0)]), sink_row_scales, 1)
    assert _wide_muls(model) == 0 and _ops(model)["Mul"] == 2


@pytest.mark.parametrize(
    "kw",
    [
        {"reader": "ReduceSum"},  # a reader that is not a product
        {"reader": "Gemm+C"},  # the scale would have to reach C too
        {"scale_shape": (1, 40)},  # a per-column scale
        {"scale_shape": (6, 40)},  # element-wise, not per row
        {"tag": False},  # forward Mul
    ],
)
def test_row_scale_left_alone(kw):
    model = _row_scaled([(0, 1, 0)], **kw)
    assert sink_row_scales(model) == 0


def test_row_scale_kept_where_the_product_is_wider():
    """Y [6, 2] x B [2, 40]: scaling the [6, 40] product would cost more than Y."""
    g = TinyGraph()
    y = g.op("Mul", g.input("x", (6, 2)), g.input("c", (6, 1)), name="scale", shape=(6, 2))
    out = _grad(g.op("Gemm", _grad(y), g.input("b", (2, 40)), name="gemm", shape=(6, 40)))
    assert sink_row_scales(g.model(out)) == 0


# --- 2. exported models: loss and gradients before vs after each pass ------------------------


class _HandWrittenLayerNorm(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(d))
        self.bias = torch.nn.Parameter(0.1 * torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        return self.weight * ((x - u) / torch.sqrt(s + 1e-5)) + self.bias


class _LayerNormMLP(torch.nn.Module):
    """Pre-LN MLP block with hand-written LayerNorms and an erf GELU."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.ln1, self.ln2 = _HandWrittenLayerNorm(d), _HandWrittenLayerNorm(d)
        self.fc, self.proj = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x + self.proj(torch.nn.functional.gelu(self.fc(self.ln1(x))))
        return torch.nn.functional.mse_loss(self.ln2(h), y)


class _Exported:
    def __init__(self, module: torch.nn.Module, batch: dict):
        self.ex = export_forward(module, batch, train=True)
        inputs = {v.name for v in self.ex.model.graph.inputs}
        self.wrt = [n for n, _ in module.named_parameters() if n in inputs]
        feeds = {n: p.detach().numpy() for n, p in module.named_parameters()}
        feeds.update({n: b.numpy() for n, b in module.named_buffers()})
        feeds.update({k: v.numpy() for k, v in batch.items()})
        self.feeds = {k: v for k, v in feeds.items() if k in inputs}

    def train_graph(
        self, fusions: list[str] | None, optimize: bool = True
    ) -> tuple[ir.Model, list[str], dict]:
        model = _copy(self.ex.model)
        config = BuildConfig(
            fusions=None if fusions is None else tuple(fusions),
            optimize=optimize,
        )
        products = BuildProducts()
        inputs = BuildInputs(self.ex.output_names[0], tuple(self.wrt))
        records = run_pipeline(model, build_pipeline(config, inputs, products))
        outs = [self.ex.output_names[0], *products.grad_outputs().values()]
        return model, outs, {r.name: r for r in records}

    def run(
        self, fusions: list[str] | None, optimize: bool = True
    ) -> tuple[dict[str, np.ndarray], ir.Model, dict]:
        model, outs, records = self.train_graph(fusions, optimize)
        values = _session(model).run(outs, self.feeds)
        return dict(zip(outs, values, strict=True)), model, records


VOCAB = 256  # wider than 2 x hidden, as in real LMs: the row scale moves off the logits


@pytest.fixture(scope="module")
def exported() -> dict[str, _Exported]:
    torch.manual_seed(0)
    g = gpt2(layers=2, hidden=64, vocab=VOCAB)
    b = bert_mlm(hidden=64, layers=2, vocab=VOCAB)
    m = _LayerNormMLP()
    return {
        "gpt2": _Exported(g, lm_batches(1, batch=2, seq=16, vocab=VOCAB)[0]),
        "bert": _Exported(b, bert_batches(1, batch=2, seq=16, vocab=VOCAB)[0]),
        "ln-mlp": _Exported(m, {"x": torch.randn(2, 5, 16), "y": torch.randn(2, 5, 16)}),
    }


# Rewrites each pass makes on its own (inserted alone into the training build).
ALONE = {
    ("gpt2", "fuse_matmul_transpose"): {"com.microsoft::FusedMatMul": 3, "Mul": -2},
    ("gpt2", "fuse_skip_layer_norm"): {"com.microsoft::SkipLayerNormalization": 4},
    ("bert", "fuse_matmul_transpose"): {"com.microsoft::FusedMatMul": 16, "Transpose": -14},
    ("bert", "fuse_matmul_add"): {"Gemm": 14, "MatMul": -14, "Add": -14},
    ("bert", "fuse_bias_gelu"): {"com.microsoft::BiasGelu": 3},
    ("bert", "fuse_skip_layer_norm"): {"com.microsoft::SkipLayerNormalization": 4},
    ("gpt2", "sink_row_scale"): {"Mul": 1, "Reshape": -2},  # -1 + 2: dX's rows, H's rows
    ("bert", "sink_row_scale"): {"Mul": 2, "Reshape": -2},  # also the decoder bias's Gemm
    ("ln-mlp", "fuse_layer_norm"): {"LayerNormalization": 2, "ReduceMean": -4},
    ("ln-mlp", "fuse_matmul_add"): {"Gemm": 2},
    ("ln-mlp", "fuse_bias_gelu"): {"com.microsoft::BiasGelu": 1},
}


def _assert_same(after: dict, before: dict, what: str) -> None:
    assert after.keys() == before.keys()
    # Gradients that are zero in exact arithmetic (attention key biases: softmax ignores a
    # constant shift) are rounding noise; below this floor both must just be noise.
    floor = 1e-7 * max(float(np.abs(v).max()) for v in before.values())
    for k in before:
        if float(np.abs(before[k]).max()) < floor:
            assert float(np.abs(after[k]).max()) < floor, f"{what}: {k} is not ~0"
        else:
            assert_close(after[k], before[k], f"{what}: {k}")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FUSIONS))
@pytest.mark.parametrize("model_name", ["gpt2", "bert", "ln-mlp"])
def test_pass_keeps_loss_and_gradients(exported, model_name, name):
    ex = exported[model_name]
    before, _, _ = ex.run([])
    after, _, records = ex.run([name])
    _assert_same(after, before, f"{model_name} +{name}")
    delta = records[name].op_delta
    for op, change in ALONE.get((model_name, name), {}).items():
        assert delta.get(op) == change, (op, delta)
    if (model_name, name) in ALONE:
        assert records[name].modified


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["gpt2", "bert", "ln-mlp"])
def test_proposed_pipeline_keeps_loss_and_gradients(exported, model_name):
    ex = exported[model_name]
    before, _, _ = ex.run([])
    after, _, _ = ex.run([p.name for p in _proposed()])
    _assert_same(after, before, f"{model_name} proposed fusions")


@pytest.mark.parametrize("model_name", ["gpt2", "bert", "ln-mlp"])
def test_all_optimization_passes_keep_loss_and_gradients(exported, model_name):
    """optimize=True (clean_forward, fuse_gelu, the default fusions, fold_transpose_gemm,
    lower_cross_entropy, clean_backward) against the plain gradient graph."""
    ex = exported[model_name]
    plain, plain_model, plain_records = ex.run(None, optimize=False)
    optimized, model, records = ex.run(None, optimize=True)
    assert "clean_forward" not in plain_records and "fuse_gelu" not in plain_records
    _assert_same(optimized, plain, f"{model_name} optimize_graph")
    assert len(model.graph) < len(plain_model.graph)
    assert {"clean_forward", "pad_as_concat", "fuse_gelu", "clean_backward"} <= records.keys()


@pytest.mark.parametrize("model_name, padded", [("gpt2", True), ("bert", False)])
def test_pad_as_concat_in_the_training_build(exported, model_name, padded):
    """GPT-2's loss pads its int64 labels (no CUDA kernel): one Concat instead; BERT has
    no Pad. Loss and gradients: test_all_optimization_passes_keep_loss_and_gradients."""
    _, model, records = exported[model_name].run(None, optimize=True)
    assert records["pad_as_concat"].op_delta == ({"Pad": -1, "Concat": 1} if padded else {})
    assert not any(n.op_type == "Pad" for n in model.graph)


# --- 3. structure after the proposed pipeline ----------------------------------------------


def _proposed():
    plan = training_fusions()
    return plan.before_autodiff + plan.after_autodiff


def test_training_fusions_order():
    plan = training_fusions()
    assert [p.name for p in plan.before_autodiff] == [
        "fuse_layer_norm", "fuse_rms_norm", "fuse_matmul_transpose", "fuse_matmul_add",
        "fuse_bias_gelu",
    ]  # fmt: skip
    assert [p.name for p in plan.after_autodiff] == ["clean_backward", "sink_row_scale"]
    everything = training_fusions(list(FUSIONS))  # pipeline order, whatever the order asked
    assert [p.name for p in everything.before_autodiff][-1] == "fuse_skip_layer_norm"
    passes = [p.name for p in build_pipeline(BuildConfig(), BuildInputs("loss"), BuildProducts())]
    assert passes.index("fuse_gelu") < passes.index("fuse_layer_norm")
    assert passes.index("fuse_bias_gelu") < passes.index("autodiff")
    assert passes.index("fuse_rms_norm") < passes.index("pow_as_mul")  # its pattern reads Pow
    assert passes.index("lower_cross_entropy") < passes.index("clean_backward")
    with pytest.raises(ValueError, match="unknown fusions"):
        training_fusions(["fuse_everything"])


def _products_fed_by_transposes(model: ir.Model) -> collections.Counter:
    edges: collections.Counter = collections.Counter()
    for node in model.graph:
        if node.op_type != "Transpose":
            continue
        perm = tuple(node.attributes["perm"].value)
        for user, _ in node.outputs[0].uses():
            if user.op_type in ("MatMul", "FusedMatMul", "Gemm"):
                edges[(perm, user.op_type)] += 1
    return edges


@pytest.mark.parametrize("model_name", ["gpt2", "bert"])
def test_structure_after_proposed_pipeline(exported, model_name):
    model, _, _ = exported[model_name].train_graph([p.name for p in _proposed()])
    forward = collections.Counter(n.op_type for n in model.graph if GRAD_OF not in n.metadata_props)
    # No decomposed GELU or LayerNorm chain is left in the forward graph.
    for op in ("Tanh", "Erf", "Pow", "Sqrt", "ReduceMean", "Reciprocal"):
        assert forward[op] == 0, op
    # The only Transposes feeding a product are attention head permutations [0, 2, 1, 3]
    # (no FusedMatMul attribute absorbs them): per layer q, k and v into the forward
    # products and the backward ones that read them, dY of the context into two backward
    # products. No Transpose of a weight, no K^T, none that swaps the last two axes.
    layers = 2
    assert _products_fed_by_transposes(model) == {
        ((0, 2, 1, 3), "FusedMatMul"): 7 * layers,
        ((0, 2, 1, 3), "MatMul"): 1 * layers,
    }
    if model_name == "gpt2":  # Conv1D already exports as Gemm; the LM head and QK^T fuse
        assert forward["FusedMatMul"] == 1 + layers and forward["Gelu"] == layers
        assert forward["LayerNormalization"] == 2 * layers + 1
    else:  # every nn.Linear is one Gemm with its bias, BERT's GELUs read its output
        assert forward["Gemm"] == 6 * layers + 2 and forward["MatMul"] == layers
        assert forward["FusedMatMul"] == layers
        assert forward["Gelu"] == layers + 1 and forward["BiasGelu"] == 0
        assert forward["LayerNormalization"] == 2 * layers + 2
    assert forward["Mul"] == 0  # attention scales are FusedMatMul alphas
