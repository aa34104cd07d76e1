"""ortrain's fused CPU backward kernels (``ortrain/runtime/grad_kernels.c``) and their use.

- each kernel against numpy in float64 (shapes below, at and across its block size,
  ragged widths, large inputs where exp saturates) and against the standard-op spelling
  the gradient rules emit without it (rules/nn.py), through ONNX Runtime;
- results that do not depend on the thread count (bit for bit), clear errors on bad
  shapes and indices;
- the rules emit them only for fp32 CPU builds; ``scatter_rows`` on hand-built graphs;
- training with them against eager on models beyond GPT-2 / BERT (erf and tanh GELU,
  LayerNorm with and without the residual fused in, embeddings with repeated and padding
  rows), and ``TrainerOptions.cpu_kernels``.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper
from scipy.special import erf

from ortrain import TrainerOptions
from ortrain.core.names import CPU_DOMAIN
from ortrain.graph_passes.autodiff import build_gradient_graph
from ortrain.graph_passes.targets.cpu.scatter_rows import lower_scatter_add_rows
from ortrain.runtime import cpu_ops
from tests.test_model_families import FAMILIES, NO_DROPOUT, Family, _batch, _trains_like_eager

F32, I64 = TensorProto.FLOAT, TensorProto.INT64
EPS32 = float(np.finfo(np.float32).eps)


def _library() -> str:
    """The built library. Skips only without a C compiler; a compile or load failure of
    the library itself fails the test."""
    try:
        cpu_ops._compiler()
    except cpu_ops.CpuOpsLibraryError as exc:
        pytest.skip(f"ortrain's CPU op library cannot be built here: {exc}")
    return str(cpu_ops.library_path())


def _run(
    op: str, feeds: dict[str, np.ndarray], outputs: int = 1, threads: int = 2
) -> list[np.ndarray]:
    types = {np.dtype(np.float32): F32, np.dtype(np.int64): I64}
    vis = [helper.make_tensor_value_info(n, types[v.dtype], v.shape) for n, v in feeds.items()]
    outs = [f"out{i}" for i in range(outputs)]
    node = helper.make_node(op, list(feeds), outs, domain=CPU_DOMAIN)
    out_vis = [helper.make_tensor_value_info(n, F32, None) for n in outs]
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(CPU_DOMAIN, 1)]
    proto = helper.make_model(helper.make_graph([node], "g", vis, out_vis), opset_imports=opsets)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.register_custom_ops_library(_library())
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _f32(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _assert_close(got: np.ndarray, want: np.ndarray, magnitude: np.ndarray, ulps: float) -> None:
    """|got - want| <= ulps float32 unit roundoffs of each element's term magnitude."""
    assert got.dtype == np.float32 and got.shape == want.shape
    tol = ulps * EPS32 / 2 * magnitude + np.finfo(np.float32).tiny
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= tol), f"worst excess {np.max(err - tol):.3g} at {np.argmax(err - tol)}"


# --------------------------------------------------------------------------- GELU
SHAPES = [(7,), (3, 33), (2, 16384), (5, 4099), (8, 128, 96)]  # ragged, one block, several


def _gelu_slope(x: np.ndarray, tanh: bool) -> np.ndarray:
    if tanh:
        k, a = math.sqrt(2 / math.pi), 0.044715
        t = np.tanh(k * (x + a * x**3))
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * a * x * x)
    return 0.5 * (1 + erf(x / math.sqrt(2))) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


@pytest.mark.parametrize("tanh", [False, True], ids=["erf", "tanh"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gelu_grad_matches_float64(shape: tuple[int, ...], tanh: bool) -> None:
    rng = np.random.default_rng(len(shape) + tanh)
    x, dy = _f32(rng, shape, 3.0), _f32(rng, shape)
    x.reshape(-1)[:4] = [0.0, -60.0, 60.0, 1e-30]  # exp saturating both ways, zero, tiny
    (got,) = _run("FastGeluGrad" if tanh else "GeluGrad", {"dY": dy, "X": x})
    slope = _gelu_slope(x.astype(np.float64), tanh)
    want = dy * slope
    # the slope's own float32 evaluation: a few ulps of its largest term (<= 1.2 + |x phi|)
    _assert_close(got, want, np.abs(dy) * (np.abs(slope) + 1.0), ulps=16)


# --------------------------------------------------------------------------- Softmax
@pytest.mark.parametrize("shape", [(3, 5), (4, 2, 128), (2, 9000), (1, 1)], ids=str)
def test_softmax_grad_matches_float64(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(3)
    logits, dy = _f32(rng, shape, 4.0), _f32(rng, shape)
    y = np.exp(logits - logits.max(-1, keepdims=True))
    y = (y / y.sum(-1, keepdims=True)).astype(np.float32)
    (got,) = _run("SoftmaxGrad", {"dY": dy, "Y": y})
    y64, dy64 = y.astype(np.float64), dy.astype(np.float64)
    s = (dy64 * y64).sum(-1, keepdims=True)
    magnitude = y64 * (np.abs(dy64) + (np.abs(dy64) * y64).sum(-1, keepdims=True))
    _assert_close(got, y64 * (dy64 - s), magnitude, ulps=4 * math.sqrt(shape[-1]))


# --------------------------------------------------------------------------- LayerNorm
def _layer_norm_feeds(shape: tuple[int, ...], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x, dy = _f32(rng, shape, 2.0) + 0.5, _f32(rng, shape)
    x64 = x.astype(np.float64)
    mean = x64.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
    scale = _f32(rng, shape[-1:]) + 1.0
    return {
        "dY": dy,
        "X": x,
        "scale": scale,
        "mean": mean.astype(np.float32),
        "inv_std": rstd.astype(np.float32),
    }


@pytest.mark.parametrize("shape", [(4, 7), (2, 3, 256), (1000, 33), (64, 1024), (3, 1)], ids=str)
def test_layer_norm_grad_matches_float64(shape: tuple[int, ...]) -> None:
    feeds = _layer_norm_feeds(shape)
    dx, dscale, dbias = _run("LayerNormGrad", feeds, outputs=3)
    dy, x, scale, mean, rstd = (feeds[k].astype(np.float64) for k in feeds)
    n = shape[-1]
    xhat = (x - mean) * rstd
    g = dy * scale
    m1, m2 = g.mean(-1, keepdims=True), (g * xhat).mean(-1, keepdims=True)
    want_dx = rstd * (g - m1 - xhat * m2)
    rows = tuple(range(len(shape) - 1))
    mag_dx = rstd * (np.abs(g) + np.abs(g).mean(-1, keepdims=True) * (1 + np.abs(xhat)) * 2)
    _assert_close(dx, want_dx, mag_dx, ulps=8 * math.sqrt(n))
    r = math.prod(shape[:-1])
    _assert_close(dscale, (dy * xhat).sum(rows), np.abs(dy * xhat).sum(rows), 8 * math.sqrt(r))
    _assert_close(dbias, dy.sum(rows), np.abs(dy).sum(rows), ulps=4 * math.sqrt(r))


def test_layer_norm_grad_does_not_depend_on_threads() -> None:
    feeds = _layer_norm_feeds((1000, 96), seed=5)
    one = _run("LayerNormGrad", feeds, outputs=3, threads=1)
    two = _run("LayerNormGrad", feeds, outputs=3, threads=2)
    for a, b in zip(one, two, strict=True):
        assert np.array_equal(a, b)


def test_layer_norm_grad_names_bad_shapes() -> None:
    feeds = _layer_norm_feeds((4, 8))
    with pytest.raises(Exception, match=r"LayerNormGrad: scale has 7 elements, X's last axis 8"):
        _run("LayerNormGrad", dict(feeds, scale=feeds["scale"][:7]), outputs=3)
    with pytest.raises(Exception, match=r"mean / inv_std have 3 / 4 elements, expected one per"):
        _run("LayerNormGrad", dict(feeds, mean=feeds["mean"][:3]), outputs=3)
    with pytest.raises(Exception, match=r"LayerNormGrad: dY is \[4, 7\] but X is \[4, 8\]"):
        _run("LayerNormGrad", dict(feeds, dY=feeds["dY"][:, :7]), outputs=3)


# --------------------------------------------------------------------------- BatchNorm
def _batch_norm_feeds(shape: tuple[int, ...], seed: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "dY": _f32(rng, shape),
        "X": _f32(rng, shape, 3.0) + 1.5,  # off zero: the mean matters
        "scale": _f32(rng, shape[1:2]) + 1.0,
    }


@pytest.mark.parametrize(
    "shape", [(4, 3, 5, 5), (2, 7, 33), (16, 64, 8, 8), (5, 3), (2, 3, 4, 5, 6), (1, 2, 1)], ids=str
)
def test_batch_norm_grad_matches_float64(shape: tuple[int, ...]) -> None:
    feeds = _batch_norm_feeds(shape)
    dx, dscale, dbias = _run("BatchNormGrad", feeds, outputs=3)
    dy, x, scale = (feeds[k].astype(np.float64) for k in ("dY", "X", "scale"))
    axes = (0, *range(2, len(shape)))
    channel = [1, shape[1]] + [1] * (len(shape) - 2)
    m = math.prod(shape) // shape[1]
    mean = x.mean(axes, keepdims=True)
    rstd = 1 / np.sqrt(x.var(axes, keepdims=True) + 1e-5)
    xhat = (x - mean) * rstd
    m1, m2 = dy.mean(axes, keepdims=True), (dy * xhat).mean(axes, keepdims=True)
    k = scale.reshape(channel) * rstd
    want_dx = k * (dy - m1 - xhat * m2)
    mag = np.abs(k) * (np.abs(dy) + np.abs(dy).mean(axes, keepdims=True) * (1 + np.abs(xhat)) * 2)
    _assert_close(dx, want_dx, mag, ulps=16 * math.sqrt(m))
    _assert_close(dscale, (dy * xhat).sum(axes), np.abs(dy * xhat).sum(axes), 8 * math.sqrt(m))
    _assert_close(dbias, dy.sum(axes), np.abs(dy).sum(axes), ulps=4 * math.sqrt(m))


def test_batch_norm_grad_reads_epsilon_and_does_not_depend_on_threads() -> None:
    feeds = _batch_norm_feeds((8, 6, 7, 7), seed=5)
    one = _run("BatchNormGrad", feeds, outputs=3, threads=1)
    two = _run("BatchNormGrad", feeds, outputs=3, threads=2)
    for a, b in zip(one, two, strict=True):
        assert np.array_equal(a, b)
    # a constant channel: its variance is 0, and epsilon alone sets the scale of dX
    flat = dict(feeds, X=np.full((8, 6, 7, 7), 2.0, np.float32))
    dx = _run("BatchNormGrad", flat, outputs=3)[0]
    want = (
        feeds["scale"].reshape(1, 6, 1, 1)
        / math.sqrt(1e-5)
        * (feeds["dY"] - feeds["dY"].mean((0, 2, 3), keepdims=True))
    )
    assert np.allclose(dx, want, rtol=1e-4, atol=1e-3)


def test_batch_norm_grad_names_bad_shapes() -> None:
    feeds = _batch_norm_feeds((4, 3, 2))
    with pytest.raises(Exception, match=r"BatchNormGrad: scale has 2 elements, X's channels 3"):
        _run("BatchNormGrad", dict(feeds, scale=feeds["scale"][:2]), outputs=3)
    with pytest.raises(Exception, match=r"BatchNormGrad: dY is \[4, 3, 1\] but X is \[4, 3, 2\]"):
        _run("BatchNormGrad", dict(feeds, dY=feeds["dY"][:, :, :1]), outputs=3)


def test_batch_norm_training_pass_takes_the_exported_statistics_only() -> None:
    """An inference-mode BatchNorm fed the exporter's batch statistics is marked for the
    training gradient, its statistics behind StopGradient; its forward stays the
    exporter's (ONNX Runtime's training-mode kernel, used before, loses digits to
    cancellation). Statistics over other axes, or a var that is not the biased variance
    of the same x, stay unmarked."""
    from ortrain.core.names import BATCH_STATISTICS, STOP_GRADIENT
    from ortrain.graph_passes.cleanup.drop_stop_gradients import drop_stop_gradients
    from ortrain.graph_passes.targets.cpu.batch_norm_training import train_batch_norms

    def model(var_axes: list[int], square: bool = True) -> ir.Model:
        mk = helper.make_node
        nodes = [
            mk("ReduceMean", ["x", "axes"], ["mean"], keepdims=0),
            mk("ReduceMean", ["x", "axes"], ["mean_k"], keepdims=1),
            mk("Sub", ["x", "mean_k"], ["d"]),
            mk("Mul", ["d", "d" if square else "x"], ["sq"]),
            mk("ReduceMean", ["sq", "var_axes"], ["var"], keepdims=0),
            mk("BatchNormalization", ["x", "s", "b", "mean", "var"], ["y"], epsilon=1e-3),
        ]
        inits = [
            helper.make_tensor("axes", I64, [3], [0, 2, 3]),
            helper.make_tensor("var_axes", I64, [len(var_axes)], var_axes),
        ]
        vis = [helper.make_tensor_value_info("x", F32, [2, 3, 4, 4])]
        vis += [helper.make_tensor_value_info(n, F32, [3]) for n in ("s", "b")]
        out = [helper.make_tensor_value_info("y", F32, [2, 3, 4, 4])]
        graph = helper.make_graph(nodes, "g", vis, out, initializer=inits)
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        return ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(proto))

    good = model([0, 2, 3])
    assert train_batch_norms(good) == 1
    assert train_batch_norms(good) == 0  # once
    (bn,) = [n for n in good.graph if n.op_type == "BatchNormalization"]
    assert bn.attributes.get_int("training_mode", 0) == 0 and bn.metadata_props[BATCH_STATISTICS]
    assert bn.attributes.get_float("epsilon") == pytest.approx(1e-3)
    assert [v.producer().op_type for v in bn.inputs[3:]] == [STOP_GRADIENT] * 2
    assert drop_stop_gradients(good) == 2
    proto = ir.serde.serialize_model(good)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    x, s, b = _f32(rng, (2, 3, 4, 4)), _f32(rng, (3,)), _f32(rng, (3,))
    (y,) = sess.run(["y"], {"x": x, "s": s, "b": b})
    ref = F.batch_norm(torch.from_numpy(x), None, None, torch.from_numpy(s), torch.from_numpy(b),
                       training=True, eps=1e-3)  # fmt: skip
    assert np.allclose(y, ref.numpy(), rtol=1e-5, atol=1e-5)
    assert train_batch_norms(model([0, 2])) == 0
    assert train_batch_norms(model([0, 2, 3], square=False)) == 0


# --------------------------------------------------------------------------- scatter
@pytest.mark.parametrize(
    ("table", "n", "width"), [((50, 8), 200, 8), ((8192, 3, 5), 700, 15), ((3, 300), 1, 300)]
)
def test_scatter_add_rows_matches_float64(table: tuple[int, ...], n: int, width: int) -> None:
    rng = np.random.default_rng(7)
    base = _f32(rng, table)
    rows = rng.integers(-table[0], table[0], size=(n, 1)).astype(np.int64)  # repeats, < 0
    rows[: min(n, 5), 0] = 1  # one row hit many times
    updates = _f32(rng, (n, *table[1:]))
    (got,) = _run("ScatterAddRows", {"base": base, "rows": rows, "updates": updates})
    want, magnitude = base.astype(np.float64), np.abs(base).astype(np.float64)
    np.add.at(want, rows[:, 0], updates.astype(np.float64))
    np.add.at(magnitude, rows[:, 0], np.abs(updates).astype(np.float64))
    # a row summed from k updates: k + 1 roundings of at most its terms' magnitude
    hits = np.bincount(rows[:, 0] % table[0], minlength=table[0]).astype(np.float64)
    _assert_close(got, want, magnitude * (hits + 1).reshape(-1, *[1] * (len(table) - 1)), 2)
    (one,) = _run("ScatterAddRows", {"base": base, "rows": rows, "updates": updates}, threads=1)
    assert np.array_equal(got, one)


def test_scatter_add_rows_names_bad_indices_and_shapes() -> None:
    base, updates = np.zeros((4, 3), np.float32), np.ones((2, 3), np.float32)
    rows = np.array([[1], [4]], np.int64)
    with pytest.raises(Exception, match=r"index 4 \(entry 1\) is out of range for 4 rows"):
        _run("ScatterAddRows", {"base": base, "rows": rows, "updates": updates})
    with pytest.raises(Exception, match=r"updates \[2, 2\] do not hold one row of base \[4, 3\]"):
        _run("ScatterAddRows", {"base": base, "rows": rows - 1, "updates": updates[:, :2]})


# --------------------------------------------------------------------------- the rules
def _forward(op: str, domain: str = "", **attrs: object) -> tuple[ir.Model, list[str]]:
    """loss = sum(op(x, ...) * w): w makes the incoming gradient non-uniform."""
    shape = [6, 40]
    mk = helper.make_node
    extra = {"LayerNormalization": ["scale", "bias"], "SkipLayerNormalization": ["skip",
             "scale", "bias"], "BiasGelu": ["bias"], "FastGelu": ["bias"]}.get(op, [])  # fmt: skip
    nodes = [
        mk(op, ["x", *extra], ["y"], domain=domain, **attrs),
        mk("Mul", ["y", "w"], ["yw"]),
        mk("ReduceSum", ["yw"], ["loss"], keepdims=0),
    ]
    sizes = {"scale": [40], "bias": [40], "skip": shape}
    vis = [helper.make_tensor_value_info(n, F32, sizes.get(n, shape)) for n in ["x", "w", *extra]]
    opsets = [helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)]
    graph = helper.make_graph(nodes, "g", vis, [helper.make_tensor_value_info("loss", F32, [])])
    proto = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=opsets))
    model = ir.serde.deserialize_model(proto)
    for node in model.graph:  # contrib ops: ONNX's shape inference leaves them untyped
        for o in node.outputs:
            if o.dtype is None:
                o.dtype, o.shape = ir.DataType.FLOAT, ir.Shape(shape)
    return model, ["x", *[e for e in extra if e != "skip"]]


RULES = [
    ("Gelu", "", {}, "GeluGrad"),
    ("Gelu", "", {"approximate": "tanh"}, "FastGeluGrad"),
    ("Gelu", "com.microsoft", {}, "GeluGrad"),
    ("BiasGelu", "com.microsoft", {}, "GeluGrad"),
    ("FastGelu", "com.microsoft", {}, "FastGeluGrad"),
    ("Softmax", "", {"axis": -1}, "SoftmaxGrad"),
    ("LayerNormalization", "", {"axis": -1}, "LayerNormGrad"),
    ("SkipLayerNormalization", "com.microsoft", {}, "LayerNormGrad"),
]


@pytest.mark.parametrize(("op", "domain", "attrs", "kernel"), RULES, ids=lambda v: str(v))
def test_rules_emit_kernels_that_match_the_standard_spelling(
    op: str, domain: str, attrs: dict, kernel: str
) -> None:
    """Gradients of a graph built with the kernels against the same graph built without."""
    lib = _library()
    grads = {}
    for kernels in (False, True):
        model, wrt = _forward(op, domain, **attrs)
        res = build_gradient_graph(model, "loss", wrt, cpu_kernels=kernels)
        ops = {(n.domain, n.op_type) for n in model.graph}
        assert ((CPU_DOMAIN, kernel) in ops) == kernels, ops
        proto = ir.serde.serialize_model(model)
        so = ort.SessionOptions()
        so.register_custom_ops_library(lib)
        sess = ort.InferenceSession(
            proto.SerializeToString(), so, providers=["CPUExecutionProvider"]
        )
        dims = {
            i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in proto.graph.input
        }
        feeds = {n: _f32(np.random.default_rng(11), d) for n, d in dims.items()}
        names = [res.grad_outputs[w] for w in wrt]
        grads[kernels] = dict(zip(wrt, sess.run(names, feeds), strict=True))
    for w in grads[False]:
        ref, got = grads[False][w], grads[True][w]
        scale = np.abs(ref).max() + 1e-30
        assert np.abs(got - ref).max() <= 2e-5 * scale, (w, np.abs(got - ref).max() / scale)


def test_rules_keep_standard_ops_for_other_dtypes_and_axes() -> None:
    """fp16 values and a Softmax over another axis: no kernel (fp32, last axis only)."""
    model, wrt = _forward("Softmax", axis=0)
    build_gradient_graph(model, "loss", wrt, cpu_kernels=True)
    assert CPU_DOMAIN not in {n.domain for n in model.graph}
    model, wrt = _forward("Gelu")
    for v in model.graph.inputs:
        v.dtype = ir.DataType.FLOAT16
    for node in model.graph:
        for o in node.outputs:
            o.dtype = ir.DataType.FLOAT16
    build_gradient_graph(model, "loss", wrt, cpu_kernels=True)
    assert CPU_DOMAIN not in {n.domain for n in model.graph}


# --------------------------------------------------------------------------- scatter pass
def test_scatter_rows_pass_rewrites_row_scatters_only() -> None:
    mk = helper.make_node
    shape_nd = helper.make_tensor("nd", I64, [2], [5, 3])
    nodes = [
        mk("Expand", ["col", "nd"], ["idx"]),
        mk("ScatterElements", ["table", "idx", "upd"], ["rows"], axis=0, reduction="add"),
        mk("ScatterElements", ["table", "idx", "upd"], ["plain"], axis=0),  # no reduction
        mk("ScatterElements", ["table", "full", "upd"], ["elems"], axis=0, reduction="add"),
    ]
    vis = [
        helper.make_tensor_value_info("table", F32, [9, 3]),
        helper.make_tensor_value_info("col", I64, [5, 1]),
        helper.make_tensor_value_info("upd", F32, [5, 3]),
        helper.make_tensor_value_info("full", I64, [5, 3]),
    ]
    outs = [helper.make_tensor_value_info(n, F32, None) for n in ("rows", "plain", "elems")]
    graph = helper.make_graph(nodes, "g", vis, outs, [shape_nd])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(proto))
    assert lower_scatter_add_rows(model) == 1
    ops = {n.outputs[0].name: (n.domain, n.op_type) for n in model.graph}
    assert ops["rows"] == (CPU_DOMAIN, "ScatterAddRows")
    assert ops["plain"] == ops["elems"] == ("", "ScatterElements")
    assert ops["idx"] == ("", "Expand")  # still read by the plain scatter
    # the rewritten graph computes what the original did
    feeds = {
        "table": _f32(np.random.default_rng(1), (9, 3)),
        "col": np.array([[0], [8], [0], [-1], [4]], np.int64),
        "upd": _f32(np.random.default_rng(2), (5, 3)),
        "full": np.zeros((5, 3), np.int64),
    }
    so = ort.SessionOptions()
    so.register_custom_ops_library(_library())
    new = ir.serde.serialize_model(model).SerializeToString()
    got = ort.InferenceSession(new, so, providers=["CPUExecutionProvider"]).run(["rows"], feeds)
    want = ort.InferenceSession(proto.SerializeToString()).run(["rows"], feeds)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- training
MODELS = {
    "gpt2": Family(  # tanh GELU (FastGelu after the fusions), tied embeddings
        "GPT2LMHeadModel", "GPT2Config", "right",
        dict(n_embd=64, n_layer=2, n_head=4, n_positions=24, **NO_DROPOUT),
    ),
    "roberta": FAMILIES["roberta"],  # erf GELU, residual + LayerNorm, padding_idx rows
    "electra": FAMILIES["electra"],  # a smaller embedding projected up
    "t5": FAMILIES["t5"],  # RMSNorm, ReLU: only Softmax and embeddings
    "bart": FAMILIES["bart"],  # encoder-decoder, GELU, LayerNorms
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_trains_like_eager_on_the_kernels(name: str) -> None:
    _library()
    family = MODELS[name]
    g = torch.Generator().manual_seed(2)
    batches = [_batch(family.batch, g) for _ in range(3)]
    trainer = _trains_like_eager(
        family.build(), batches, options=TrainerOptions(cpu_kernels="ortrain")
    )
    ops = {r.stage: r.op_delta for r in trainer.build_log if r.graph == "train"}
    assert ops["autodiff"].get(f"{CPU_DOMAIN}::SoftmaxGrad", 0) >= 2, ops["autodiff"]
    if name != "t5":
        assert ops["autodiff"].get(f"{CPU_DOMAIN}::LayerNormGrad", 0) >= 2, ops["autodiff"]
    assert ops["scatter_rows"].get(f"{CPU_DOMAIN}::ScatterAddRows", 0) >= 1, ops["scatter_rows"]
    # attention Softmaxes over masked scores (tests/test_cpu_softmax.py)
    assert ops["cpu_softmax"].get(f"{CPU_DOMAIN}::Softmax", 0) >= 2, ops["cpu_softmax"]
    if name == "gpt2":  # each layer's recomputed GELU from its backward (test_gelu_value.py)
        assert ops["gelu_value"] == {"Gelu": -2}, ops["gelu_value"]


@pytest.mark.slow
def test_onnxruntime_choice_emits_no_kernels() -> None:
    family = MODELS["gpt2"]
    batches = [_batch(family.batch, torch.Generator().manual_seed(1))]
    options = TrainerOptions(cpu_kernels="onnxruntime")
    trainer = _trains_like_eager(family.build(), batches, options=options)
    for r in trainer.build_log:
        assert not any(k.startswith(CPU_DOMAIN) for k in r.op_delta), (r.stage, r.op_delta)
    assert not {"scatter_rows", "cpu_softmax"} & {r.stage for r in trainer.build_log}


# --------------------------------------------------------------------------- the option
def test_cpu_kernels_choices(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    with pytest.raises(ValueError, match="cpu_kernels must be 'auto', 'ortrain' or 'onnxruntime'"):
        TrainerOptions(cpu_kernels="fused")
    assert not cpu_ops.use_grad_kernels("onnxruntime")
    assert not cpu_ops.use_grad_kernels("ortrain", device_type="cuda")
    monkeypatch.setenv("ORTRAIN_CACHE_DIR", str(tmp_path))
    # no installed library (an empty ORTRAIN_NATIVE_DIR): the development build runs
    monkeypatch.setenv("ORTRAIN_NATIVE_DIR", str(tmp_path / "no-native"))
    cpu_ops.cache_clear()
    try:
        monkeypatch.setenv("CC", "false")  # a "compiler" that fails
        with pytest.raises(cpu_ops.CpuOpsLibraryError, match=r"cpu_kernels='ortrain': `false"):
            cpu_ops.use_grad_kernels("ortrain")
        with pytest.warns(RuntimeWarning, match="backwards run as standard ONNX ops"):
            assert not cpu_ops.use_grad_kernels("auto")
    finally:
        cpu_ops.cache_clear()
