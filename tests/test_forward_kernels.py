"""ortrain's forward CPU kernels (``ortrain/runtime/forward_kernels.c``), LayerNormGrad's
``dsum`` input, the OpenMP team, and the passes that move nodes onto them.

- ``LayerNorm`` (bias, skip and the extra outputs each optional) and ``Gelu`` /
  ``FastGelu`` against float64 references; the residual sum exact; rows far from zero
  (the variance about the mean); errors naming the op and shapes;
- results bit-identical on torch's OpenMP team, on ONNX Runtime's threads and on one;
- ``cpu_layer_norm``, ``cpu_gelu``, ``layer_norm_grad_sum`` on hand-built graphs: what
  moves, what stays, and the rewritten graph computes the original;
- GPT-2 and BERT trained against eager with all three, and their node counts.
"""

from __future__ import annotations

import copy
import ctypes

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.names import CPU_DOMAIN
from ortrain.graph_passes.targets.cpu.gelu import lower_gelu
from ortrain.graph_passes.targets.cpu.layer_norm import lower_layer_norm
from ortrain.graph_passes.targets.cpu.layer_norm_grad_sum import fold_layer_norm_grad_sums
from ortrain.runtime import cpu_ops
from tests.conftest import bert_batches, bert_mlm, gpt2, lm_batches
from tests.test_gelu_value import _gelu64
from tests.test_grad_kernels import EPS32, _f32, _library

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def _session(proto: onnx.ModelProto, threads: int = 2) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.register_custom_ops_library(_library())
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _run(
    op: str,
    feeds: dict[str, np.ndarray | None],
    outputs: list[str],
    threads: int = 2,
    **attrs: object,
) -> list[np.ndarray]:
    """One ortrain.cpu node; a None feed is an input left out (""), an output named ""
    is left out too."""
    given = {k: v for k, v in feeds.items() if v is not None}
    vis = [helper.make_tensor_value_info(n, F32, v.shape) for n, v in given.items()]
    node = helper.make_node(
        op, [k if v is not None else "" for k, v in feeds.items()], outputs, domain=CPU_DOMAIN,
        **attrs,
    )  # fmt: skip
    outs = [helper.make_tensor_value_info(n, F32, None) for n in outputs if n]
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(CPU_DOMAIN, 1)]
    proto = helper.make_model(helper.make_graph([node], "g", vis, outs), opset_imports=opsets)
    return _session(proto, threads).run(None, given)


def _layer_norm64(s: np.ndarray, scale: np.ndarray, bias: np.ndarray | None, eps: float):
    s = s.astype(np.float64)
    mean = s.mean(-1, keepdims=True)
    inv_std = 1.0 / np.sqrt(((s - mean) ** 2).mean(-1, keepdims=True) + eps)
    y = (s - mean) * inv_std * scale
    return (y + bias if bias is not None else y), mean, inv_std


# --------------------------------------------------------------------------- LayerNorm
SHAPES = [(1, 7), (3, 70), (4, 5, 768), (300, 96)]  # ragged width, several blocks


@pytest.mark.parametrize("skip", [False, True], ids=["plain", "skip"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_layer_norm_matches_float64(shape: tuple[int, ...], bias: bool, skip: bool) -> None:
    rng = np.random.default_rng(len(shape) * 4 + 2 * bias + skip)
    x, sk = _f32(rng, shape, 2.0) + 3.0, _f32(rng, shape)
    scale, b = _f32(rng, shape[-1:]), _f32(rng, shape[-1:])
    feeds = {"X": x, "scale": scale, "bias": b if bias else None, "skip": sk if skip else None}
    outs = ["Y", "mean", "inv_std"] + (["sum"] if skip else [])
    got = _run("LayerNorm", feeds, outs, epsilon=1e-3)
    s = x + sk if skip else x
    y, mean, inv_std = _layer_norm64(s, scale, b if bias else None, 1e-3)
    stat_shape = (*shape[:-1], 1)
    assert got[1].shape == stat_shape and got[2].shape == stat_shape
    # each output within a few roundoffs of its terms (the row sums: ~log2(width) more)
    mag = np.abs((s - mean) * inv_std * scale) + (np.abs(b) if bias else 0)
    tol = 64 * EPS32 * mag + 1e-6
    assert np.all(np.abs(got[0] - y) <= tol), np.max(np.abs(got[0] - y) - tol)
    np.testing.assert_allclose(got[1], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[2], inv_std, rtol=1e-5)
    if skip:
        np.testing.assert_array_equal(got[3], x + sk)  # float32 sums, as the Add made them


def test_layer_norm_variance_about_the_mean() -> None:
    """Rows at 1e4 with unit spread: E[x^2] - mean^2 would lose every digit of the
    variance in float32; the kernel's pass about the mean keeps it."""
    rng = np.random.default_rng(5)
    x = (1e4 + rng.standard_normal((16, 256))).astype(np.float32)
    scale = np.ones(256, np.float32)
    y, _, inv_std = _run("LayerNorm", {"X": x, "scale": scale}, ["Y", "m", "r"])
    want, _, want_inv = _layer_norm64(x, scale, None, 1e-5)
    np.testing.assert_allclose(inv_std, want_inv, rtol=1e-3)
    np.testing.assert_allclose(y, want, atol=2e-3)  # x's own float32 rounding at 1e4: 5e-4


def test_layer_norm_default_epsilon_and_y_alone() -> None:
    rng = np.random.default_rng(6)
    x, scale = _f32(rng, (5, 33)) * 1e-3, _f32(rng, (33,))  # var ~1e-6: epsilon matters
    (y,) = _run("LayerNorm", {"X": x, "scale": scale}, ["Y"])
    want, _, _ = _layer_norm64(x, scale, None, 1e-5)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


def test_layer_norm_errors_name_the_op_and_shapes() -> None:
    rng = np.random.default_rng(7)
    x = _f32(rng, (4, 8))
    with pytest.raises(Exception, match=r"LayerNorm: scale / bias have 7 / 8 elements"):
        _run("LayerNorm", {"X": x, "scale": _f32(rng, (7,))}, ["Y"])
    with pytest.raises(Exception, match=r"LayerNorm: X is \[4, 8\] but skip is \[4, 9\]"):
        _run("LayerNorm", {"X": x, "scale": _f32(rng, (8,)), "bias": None,
                           "skip": _f32(rng, (4, 9))}, ["Y"])  # fmt: skip
    with pytest.raises(Exception, match="the sum output needs a skip input"):
        _run("LayerNorm", {"X": x, "scale": _f32(rng, (8,))}, ["Y", "m", "r", "s"])


# ------------------------------------------------------------------------------ GELU
@pytest.mark.parametrize("op", ["Gelu", "FastGelu"])
@pytest.mark.parametrize("shape", [(7,), (3, 33), (5, 4099), (8, 128, 96)], ids=str)
def test_gelu_matches_float64(shape: tuple[int, ...], op: str) -> None:
    rng = np.random.default_rng(len(shape))
    x = _f32(rng, shape, 3.0)
    x.reshape(-1)[:4] = [0.0, -60.0, 60.0, 1e-30]
    (y,) = _run(op, {"X": x}, ["Y"])
    want = _gelu64(x, op == "FastGelu")
    # x * cdf: a few roundoffs of |x| (the cdf's fit: 1.2e-7 relative)
    tol = 8 * EPS32 / 2 * np.abs(x.astype(np.float64)) + np.finfo(np.float32).tiny
    assert np.all(np.abs(y - want) <= tol), np.max(np.abs(y - want) - tol)


def test_gelu_values_are_the_backward_kernels() -> None:
    """The forward and the GELU backward's optional Y agree bit for bit (gelu_value hands
    one for the other)."""
    rng = np.random.default_rng(9)
    x = _f32(rng, (64, 300), 3.0)
    for fwd, grad in (("Gelu", "GeluGrad"), ("FastGelu", "FastGeluGrad")):
        (y,) = _run(fwd, {"X": x}, ["Y"])
        _, y_grad = _run(grad, {"dY": np.ones_like(x), "X": x}, ["dX", "Y"])
        np.testing.assert_array_equal(y, y_grad)


# ---------------------------------------------------------------- LayerNormGrad dsum
def test_layer_norm_grad_adds_dsum() -> None:
    rng = np.random.default_rng(10)
    shape = (6, 50, 96)
    x, dy, dsum = _f32(rng, shape), _f32(rng, shape), _f32(rng, shape, 10.0)
    scale = _f32(rng, (96,))
    mean = x.mean(-1, keepdims=True).astype(np.float32)
    inv = (1 / np.sqrt(x.var(-1, keepdims=True) + 1e-5)).astype(np.float32)
    feeds = {"dY": dy, "X": x, "scale": scale, "mean": mean, "inv_std": inv}
    alone = _run("LayerNormGrad", feeds, ["dX", "ds", "db"])
    added = _run("LayerNormGrad", {**feeds, "dsum": dsum}, ["dX", "ds", "db"])
    np.testing.assert_allclose(added[0], alone[0] + dsum, rtol=0, atol=4 * EPS32 * 40)
    np.testing.assert_array_equal(added[1], alone[1])
    np.testing.assert_array_equal(added[2], alone[2])
    with pytest.raises(Exception, match=r"LayerNormGrad: dsum is \[6, 50, 95\] but X is"):
        _run("LayerNormGrad", {**feeds, "dsum": dsum[..., :95].copy()}, ["dX", "ds", "db"])


# ------------------------------------------------------------------- the OpenMP team
def test_kernels_bind_torchs_openmp_team() -> None:
    _library()
    if not cpu_ops._openmp_flags():
        pytest.skip("torch here does not run on GNU OpenMP")
    assert cpu_ops.omp_team(), "the library should share torch's OpenMP runtime"


@pytest.mark.parametrize("op", ["LayerNorm", "FastGelu", "LayerNormGrad", "SoftmaxGrad"])
def test_results_do_not_depend_on_the_threads(op: str) -> None:
    rng = np.random.default_rng(11)
    x, dy = _f32(rng, (700, 96)), _f32(rng, (700, 96))
    scale = _f32(rng, (96,))
    feeds: dict[str, np.ndarray | None] = {
        "LayerNorm": {"X": x, "scale": scale, "bias": scale, "skip": dy},
        "FastGelu": {"X": x},
        "LayerNormGrad": {"dY": dy, "X": x, "scale": scale, "mean": x[:, :1].copy(),
                          "inv_std": np.abs(x[:, :1]) + 1, "dsum": dy},
        "SoftmaxGrad": {"dY": dy, "Y": np.abs(x)},
    }[op]  # fmt: skip
    n_out = {"LayerNorm": 4, "FastGelu": 1, "LayerNormGrad": 3, "SoftmaxGrad": 1}[op]
    outs = [f"o{i}" for i in range(n_out)]
    lib = ctypes.CDLL(_library())
    was = int(cpu_ops.omp_team())
    try:
        results = []
        for team, threads in ((1, 2), (0, 2), (0, 1)):
            lib.ortrain_use_omp_team(team)
            results.append(_run(op, feeds, outs, threads=threads))
    finally:
        lib.ortrain_use_omp_team(was)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------------- the passes
def _graph(nodes: list, inputs: dict[str, tuple[int, list[int]]], outputs: list[str], opset=20):
    """Outputs named ``*16`` or ``half`` are float16."""
    vis = [helper.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()]
    half = {n for n in outputs if n.endswith("16") or n == "half"}
    outs = [helper.make_tensor_value_info(n, F16 if n in half else F32, None) for n in outputs]
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1),
              helper.make_opsetid(CPU_DOMAIN, 1)]  # fmt: skip
    proto = helper.make_model(helper.make_graph(nodes, "g", vis, outs), opset_imports=opsets)
    proto = onnx.shape_inference.infer_shapes(proto)
    return proto, ir.serde.deserialize_model(proto)


def _same_outputs(proto: onnx.ModelProto, model: ir.Model, feeds: dict[str, np.ndarray]) -> None:
    new = ir.serde.serialize_model(model)
    got = _session(new).run(None, feeds)
    want = ort.InferenceSession(proto.SerializeToString()).run(None, feeds)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-6)


def _ops(model: ir.Model) -> list[str]:
    return [f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in model.graph]


def test_layer_norm_pass_takes_in_the_residual_add() -> None:
    mk = helper.make_node
    nodes = [
        mk("Add", ["a", "b"], ["h"]),
        mk("LayerNormalization", ["h", "g", "beta"], ["y", "mu", "rs"], epsilon=1e-3),
        mk("Add", ["h", "y"], ["h2"]),  # the residual stream reads the sum on
        mk("LayerNormalization", ["h", "g"], ["y_again"]),  # a recomputed copy
        mk("Add", ["a", "row"], ["hb"]),  # broadcast: stays an Add
        mk("LayerNormalization", ["hb", "g", "beta"], ["yb"]),
        mk("LayerNormalization", ["a", "g2", "beta2"], ["ya"], axis=0),  # not the last axis
        mk("LayerNormalization", ["a16", "g16"], ["y16"]),  # fp16 stays
        mk("Add", ["a", "b"], ["hout"]),  # a graph output: the Add stays
        mk("LayerNormalization", ["hout", "g"], ["yout"]),
    ]
    inputs = {
        "a": (F32, [4, 6, 32]), "b": (F32, [4, 6, 32]), "row": (F32, [32]),
        "g": (F32, [32]), "beta": (F32, [32]), "g2": (F32, [4, 6, 32]),
        "beta2": (F32, [4, 6, 32]), "a16": (F16, [3, 8]), "g16": (F16, [8]),
    }  # fmt: skip
    outputs = ["h2", "mu", "rs", "y_again", "yb", "ya", "y16", "hout", "yout"]
    proto, model = _graph(nodes, inputs, outputs)
    assert lower_layer_norm(model) == 4
    ops = _ops(model)
    assert ops.count(f"{CPU_DOMAIN}::LayerNorm") == 4
    assert ops.count("LayerNormalization") == 2  # axis 0, fp16
    assert ops.count("Add") == 3  # the residual's h2, the broadcast one, the graph output's
    fused = next(n for n in model.graph if len(n.inputs) == 4)
    assert [v.name for v in fused.inputs] == ["a", "g", "beta", "b"]
    assert fused.outputs[3].name == "h" and fused.attributes["epsilon"].value == pytest.approx(1e-3)
    rng = np.random.default_rng(0)
    feeds = {n: (_f32(rng, tuple(s)) if t == F32 else _f32(rng, tuple(s)).astype(np.float16))
             for n, (t, s) in inputs.items()}  # fmt: skip
    _same_outputs(proto, model, feeds)
    assert lower_layer_norm(model) == 0  # nothing left to move


def test_gelu_pass() -> None:
    mk = helper.make_node
    nodes = [
        mk("Gelu", ["x"], ["erf"]),
        mk("Gelu", ["x"], ["tanh"], approximate="tanh"),
        mk("Gelu", ["x"], ["ms_erf"], domain="com.microsoft"),
        mk("FastGelu", ["x"], ["ms_tanh"], domain="com.microsoft"),
        mk("FastGelu", ["x", "bias"], ["ms_bias"], domain="com.microsoft"),  # stays
        mk("Gelu", ["x16"], ["half"]),  # stays
    ]
    inputs = {"x": (F32, [5, 40]), "bias": (F32, [40]), "x16": (F16, [3, 4])}
    proto, model = _graph(nodes, inputs, ["erf", "tanh", "ms_erf", "ms_tanh", "ms_bias", "half"])
    assert lower_gelu(model) == 4
    assert _ops(model) == [
        f"{CPU_DOMAIN}::Gelu", f"{CPU_DOMAIN}::FastGelu", f"{CPU_DOMAIN}::Gelu",
        f"{CPU_DOMAIN}::FastGelu", "com.microsoft::FastGelu", "Gelu",
    ]  # fmt: skip
    rng = np.random.default_rng(1)
    feeds = {"x": _f32(rng, (5, 40), 3.0), "bias": _f32(rng, (40,)),
             "x16": _f32(rng, (3, 4)).astype(np.float16)}  # fmt: skip
    _same_outputs(proto, model, feeds)


def test_layer_norm_grad_sum_pass() -> None:
    mk = helper.make_node
    lng = ["dy", "x", "g", "mu", "rs"]
    nodes = [
        mk("LayerNormGrad", lng, ["dx0", "dg0", "db0"], domain=CPU_DOMAIN),
        mk("Sum", ["d0", "dx0"], ["s0"]),  # taken in
        mk("LayerNormGrad", lng, ["dx1", "dg1", "db1"], domain=CPU_DOMAIN),
        mk("Relu", ["d0"], ["late"]),  # made after the kernel: the kernel moves
        mk("Add", ["dx1", "late"], ["s1"]),
        mk("LayerNormGrad", lng, ["dx2", "dg2", "db2"], domain=CPU_DOMAIN),
        mk("Sum", ["dx2", "d0", "d0"], ["s2"]),  # three operands: stays
        mk("Neg", ["dx2"], ["n2"]),
        mk("LayerNormGrad", lng, ["dx3", "dg3", "db3"], domain=CPU_DOMAIN),
        mk("Sum", ["dx3", "row"], ["s3"]),  # broadcast: stays
    ]
    shape = [4, 6, 32]
    inputs = {"dy": (F32, shape), "x": (F32, shape), "g": (F32, [32]), "mu": (F32, [4, 6, 1]),
              "rs": (F32, [4, 6, 1]), "d0": (F32, shape), "row": (F32, [32])}  # fmt: skip
    outputs = ["s0", "dg0", "s1", "db1", "s2", "n2", "s3"]
    proto, model = _graph(nodes, inputs, outputs)
    for node in model.graph:  # shape inference cannot see through the custom op
        if node.op_type in ("LayerNormGrad", "Sum", "Add"):
            for v, s in zip(node.outputs, [shape, [32], [32]], strict=False):
                v.shape, v.dtype = ir.Shape(s), ir.DataType.FLOAT
    assert fold_layer_norm_grad_sums(model) == 2
    ops = _ops(model)
    assert ops.count("Sum") == 2 and ops.count("Add") == 0
    kernels = [n for n in model.graph if n.op_type == "LayerNormGrad"]
    assert sum(len(k.inputs) == 6 for k in kernels) == 2
    order = {n.outputs[0].name: i for i, n in enumerate(model.graph)}
    assert order["s1"] > order["late"]  # the moved kernel runs after what it reads
    rng = np.random.default_rng(2)
    feeds = {n: _f32(rng, tuple(s)) for n, (_, s) in inputs.items()}
    feeds["rs"] = np.abs(feeds["rs"]) + 0.5
    got = _session(ir.serde.serialize_model(model)).run(None, feeds)
    # the original graph needs the library too: it holds the kernels
    want = _session(proto).run(None, feeds)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------ whole models
def _counts(model: ir.Model) -> dict[str, int]:
    out: dict[str, int] = {}
    for op in _ops(model):
        out[op] = out.get(op, 0) + 1
    return out


def train_against_eager(
    model, batches, opt_cls, options: TrainerOptions | None = None, **kw
) -> ORTTrainer:
    """Train ``model`` with ortrain's CPU kernels (or ``options``) and a deep copy in eager
    side by side: losses each step and parameters at the end, element-wise."""
    ref = copy.deepcopy(model)
    options = options or TrainerOptions(cpu_kernels="ortrain")
    trainer = ORTTrainer(model, opt_cls(model.parameters(), **kw), options)
    ref_opt = opt_cls(ref.parameters(), **kw)
    for batch in batches:
        loss = trainer.train_step(**batch)
        ref_opt.zero_grad()
        want = ref(**batch).loss
        want.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, want.detach(), rtol=2e-5, atol=2e-5)
    trainer.sync_to_module()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=2e-5, msg=name)
    return trainer


@pytest.mark.slow
def test_gpt2_trains_on_the_forward_kernels() -> None:
    _library()
    model = gpt2(layers=3, hidden=64, vocab=128)
    # SGD: a parameter's error stays the size of its gradients' (Adam's 1 / sqrt(v) would
    # blow up a gradient that is ~0 in one and 1e-9 in the other)
    batches = lm_batches(3, vocab=128)
    trainer = train_against_eager(model, batches, torch.optim.SGD, lr=0.5, momentum=0.9)
    c = _counts(trainer.train_graphs[0])
    # 3 layers x 2 LayerNorms + the final one, each once forward and once recomputed
    assert c.get(f"{CPU_DOMAIN}::LayerNorm") == 14 and "LayerNormalization" not in c
    assert c.get(f"{CPU_DOMAIN}::FastGelu") == 3 and "Gelu" not in c
    # the embeddings' (positions broadcast) and the cross-entropy's loss (its logsumexp
    # read off the largest probability, lower_cross_entropy.py); residuals fused
    assert c.get("Add", 0) == 2
    assert c.get("Sum", 0) == 0  # the residual gradients' Sums are in LayerNormGrad
    fused = [n for n in trainer.train_graphs[0].graph if n.op_type == "LayerNorm"
             and len(n.inputs) == 4]  # fmt: skip
    assert len(fused) == 6  # every residual Add but the embeddings'


@pytest.mark.slow
def test_bert_trains_on_the_forward_kernels() -> None:
    _library()
    model = bert_mlm(hidden=64, layers=2, vocab=128)
    batches = bert_batches(3, vocab=128)
    trainer = train_against_eager(model, batches, torch.optim.SGD, lr=0.5, momentum=0.9)
    c = _counts(trainer.train_graphs[0])
    assert "LayerNormalization" not in c and "Gelu" not in c
    # erf GELUs: two layers' and the MLM head's, plus the head's copy recomputed for its
    # LayerNorm's backward (the GELU kernel there runs after that LayerNorm's gradient)
    assert c.get(f"{CPU_DOMAIN}::Gelu") == 4
    # eval: the forward kernels too, computing the module's eval forward
    out = trainer.eval_step(**batches[0])
    model.eval()
    with torch.no_grad():
        want = model(**batches[0])
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-4, atol=1e-5)
    eval_rec = [r for r in trainer.build_log if r.graph == "eval" and r.stage == "cpu_layer_norm"]
    assert eval_rec and eval_rec[0].op_delta.get(f"{CPU_DOMAIN}::LayerNorm", 0) > 0
