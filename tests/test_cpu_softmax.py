"""``ortrain.cpu.Softmax`` (``ortrain/runtime/softmax.c``) and the ``cpu_softmax`` pass.

- the kernel against numpy in float64: ragged widths, one and several blocks, rows with
  masked logits (finfo.min, -inf, below exp's range), every way a bias may broadcast;
- NaN where ONNX's Softmax gives NaN (rows all -inf, +inf, NaN), bit-identical results
  at 1 and 2 threads, errors naming the op and both shapes;
- the pass on hand-built graphs: which Softmaxes move, when the Add is taken in, and the
  rewritten graph computes the original; GPT-2 / BERT graphs built by the trainer.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.names import CPU_DOMAIN
from ortrain.graph_passes.fusions.lower_cross_entropy import LOWERED_FROM
from ortrain.graph_passes.targets.cpu.cost_model import CpuCostModel
from ortrain.graph_passes.targets.cpu.softmax import BELOW_EXP, can_hold_masked, lower_softmax
from tests.test_cpu_cost_model import cost
from tests.test_grad_kernels import EPS32, _f32, _library, _run

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
MIN32 = float(np.finfo(np.float32).min)


def _softmax64(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _assert_softmax(got: np.ndarray, z: np.ndarray) -> None:
    """Within a few float32 unit roundoffs of each probability (exp's 2e-7, the sum over
    the row, the division), plus the rounding of z - max(z) in float32, which exp turns
    into a relative error of |z - max| roundoffs; and a tiny floor for the exp < 2^-125
    that the kernel flushes to 0."""
    want = _softmax64(z)
    assert got.dtype == np.float32 and got.shape == want.shape
    spread = np.abs(z.astype(np.float64) - z.max(-1, keepdims=True))
    spread[~np.isfinite(spread)] = 0.0
    tol = (8 + spread) * EPS32 * want + 1e-37
    err = np.abs(got - want)
    assert np.all(err <= tol), f"worst excess {np.max(err - tol):.3g} at {np.argmax(err - tol)}"
    np.testing.assert_allclose(got.sum(-1, dtype=np.float64), 1.0, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- the kernel
@pytest.mark.parametrize(
    "shape", [(1,), (3, 5), (4, 2, 17), (2, 9000), (33, 128), (2, 3, 128, 128)], ids=str
)
def test_softmax_matches_float64(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(len(shape))
    x = _f32(rng, shape, 4.0)
    (got,) = _run("Softmax", {"X": x})
    _assert_softmax(got, x)


@pytest.mark.parametrize("masked", [MIN32, -np.inf, -200.0, -88.0], ids=str)
def test_masked_rows_match_float64(masked: float) -> None:
    rng = np.random.default_rng(7)
    x = _f32(rng, (2, 4, 40, 40), 3.0)
    causal = np.triu(np.ones((40, 40), bool), 1)
    x = np.where(causal, np.float32(masked), x).astype(np.float32)
    (got,) = _run("Softmax", {"X": x})
    _assert_softmax(got, x)
    assert np.all(got[..., causal] == 0.0 if masked != -88.0 else got[..., causal] < 1e-30)


BIAS_SHAPES = [(40,), (1, 40), (40, 40), (2, 1, 40, 40), (2, 1, 1, 40), (1, 4, 40, 40)]


@pytest.mark.parametrize("bias_shape", BIAS_SHAPES, ids=str)
def test_bias_broadcasts_like_add(bias_shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(11)
    x = _f32(rng, (2, 4, 40, 40), 3.0)
    bias = np.where(rng.random(bias_shape) < 0.3, MIN32, _f32(rng, bias_shape)).astype(np.float32)
    (got,) = _run("Softmax", {"X": x, "bias": bias})
    _assert_softmax(got, (x + bias).astype(np.float32))  # X + bias rounded in float32, as Add


def test_nan_rows_as_onnx() -> None:
    x = _f32(np.random.default_rng(2), (4, 20))
    x[0] = -np.inf  # every logit masked
    x[1, 3] = np.inf
    x[2, 5] = np.nan
    (got,) = _run("Softmax", {"X": x})
    assert np.isnan(got[:3]).all()
    _assert_softmax(got[3:], x[3:])


def test_results_do_not_depend_on_threads() -> None:
    rng = np.random.default_rng(4)
    feeds = {"X": _f32(rng, (8, 4, 64, 300), 4.0), "bias": _f32(rng, (8, 1, 64, 300))}
    (one,) = _run("Softmax", feeds, threads=1)
    (two,) = _run("Softmax", feeds, threads=2)
    np.testing.assert_array_equal(one, two)


def test_names_bad_bias_shapes() -> None:
    x = np.zeros((2, 3, 8), np.float32)
    for bad in [(2, 3, 1), (3, 3, 8), (4, 2, 3, 8)]:
        with pytest.raises(
            Exception, match=r"ortrain\.cpu\.Softmax: bias \[.*\] does not broadcast"
        ):
            _run("Softmax", {"X": x, "bias": np.zeros(bad, np.float32)})
    with pytest.raises(Exception, match=r"ortrain\.cpu\.Softmax: X is a scalar"):
        _run("Softmax", {"X": np.zeros((), np.float32)})


# --------------------------------------------------------------------------- the pass
def _graph(nodes: list, inputs: dict[str, tuple[int, list[int]]], outputs: list[str], opset=17):
    vis = [helper.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()]
    outs = [helper.make_tensor_value_info(n, F32, None) for n in outputs]
    proto = helper.make_model(
        helper.make_graph(nodes, "g", vis, outs), opset_imports=[helper.make_opsetid("", opset)]
    )
    proto = onnx.shape_inference.infer_shapes(proto)
    return proto, ir.serde.deserialize_model(proto)


def _same_outputs(proto: onnx.ModelProto, model: ir.Model, feeds: dict[str, np.ndarray]) -> None:
    so = ort.SessionOptions()
    so.register_custom_ops_library(_library())
    new = ir.serde.serialize_model(model).SerializeToString()
    got = ort.InferenceSession(new, so, providers=["CPUExecutionProvider"]).run(None, feeds)
    want = ort.InferenceSession(proto.SerializeToString()).run(None, feeds)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-7)


def _const(name: str, value: float | np.ndarray) -> onnx.NodeProto:
    array = np.asarray(value, dtype=np.float32)
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array, name))


def test_pass_takes_in_the_mask_add() -> None:
    """The mask as torch.onnx exports it, ``Where(keep, 0, finfo.min)``: the graph shows
    it holds masked logits."""
    mk = helper.make_node
    nodes = [
        _const("zero", 0.0),
        _const("lowest", MIN32),
        mk("Where", ["keep", "zero", "lowest"], ["mask"]),
        mk("Add", ["scores", "mask"], ["z"]),
        mk("Softmax", ["z"], ["p"], axis=-1),
        mk("Add", ["mask", "scores"], ["z2"]),  # the mask first
        mk("Softmax", ["z2"], ["p2"]),
        mk("Add", ["scores", "mask"], ["z3"]),  # also an output: the Add stays
        mk("Softmax", ["z3"], ["p3"], axis=3),
    ]
    inputs = {"scores": (F32, [2, 4, 6, 6]), "keep": (TensorProto.BOOL, [2, 1, 6, 6])}
    proto, model = _graph(nodes, inputs, ["p", "p2", "p3", "z3"])
    assert lower_softmax(model) == 3
    ops = [(n.domain, n.op_type, len(n.inputs)) for n in model.graph if n.op_type != "Constant"]
    assert ops == [("", "Where", 3)] + [(CPU_DOMAIN, "Softmax", 2)] * 2 + [
        ("", "Add", 2),
        (CPU_DOMAIN, "Softmax", 1),
    ]
    assert model.opset_imports[CPU_DOMAIN] == 1
    rng = np.random.default_rng(0)
    keep = np.tril(np.ones((6, 6), bool))
    feeds = {"scores": _f32(rng, (2, 4, 6, 6)), "keep": np.broadcast_to(keep, (2, 1, 6, 6)).copy()}
    _same_outputs(proto, model, feeds)


def test_pass_leaves_dense_other_axis_and_half_softmaxes() -> None:
    mk = helper.make_node
    nodes = [
        mk("MatMul", ["a", "b"], ["logits"]),
        mk("Softmax", ["logits"], ["dense"]),  # dense short rows: ORT's is faster
        mk("Add", ["a", "bias"], ["z"]),
        mk("Softmax", ["z"], ["axis0"], axis=0),
        mk("Cast", ["a"], ["h"], to=F16),
        mk("Add", ["h", "h"], ["hz"]),
        mk("Softmax", ["hz"], ["half"]),
        mk("Cast", ["half"], ["half32"], to=F32),
        _const("fill", MIN32),
        mk("Where", ["keep", "a", "fill"], ["filled"]),  # a masked fill: moves, alone
        mk("Softmax", ["filled"], ["wp"]),
        _const("col", [[0.0], [MIN32], [0.0]]),  # a masked row, broadcast along it:
        mk("Add", ["a", "col"], ["zc"]),
        mk("Softmax", ["zc"], ["cp"]),  # moves, its Add stays
        mk("Add", ["a", "bias"], ["zb"]),  # a bias the graph does not show masks: dense
        mk("Softmax", ["zb"], ["biased"]),
        mk("Where", ["keep", "a", "bias"], ["wb"]),  # a fill of unknown values: dense
        mk("Softmax", ["wb"], ["wbp"]),
    ]
    inputs = {
        "a": (F32, [3, 5]),
        "b": (F32, [5, 5]),
        "bias": (F32, [1, 5]),
        "keep": (TensorProto.BOOL, [3, 5]),
    }
    outputs = ["dense", "axis0", "half32", "wp", "cp", "biased", "wbp"]
    proto, model = _graph(nodes, inputs, outputs)
    assert lower_softmax(model) == 2
    by_out = {n.outputs[0].name: (n.domain, n.op_type, len(n.inputs)) for n in model.graph}
    assert by_out["dense"] == by_out["axis0"] == by_out["half"] == ("", "Softmax", 1)
    assert by_out["biased"] == by_out["wbp"] == ("", "Softmax", 1)
    assert by_out["wp"] == by_out["cp"] == (CPU_DOMAIN, "Softmax", 1)
    assert by_out["zc"] == ("", "Add", 2)
    rng = np.random.default_rng(3)
    feeds = {
        "a": _f32(rng, (3, 5)),
        "b": _f32(rng, (5, 5)),
        "bias": _f32(rng, (1, 5)),
        "keep": rng.random((3, 5)) < 0.5,
    }
    _same_outputs(proto, model, feeds)


def test_pass_moves_a_loss_heads_long_rows() -> None:
    """A loss head's dense Softmax (tagged by lower_cross_entropy.py) moves from the cost
    model's row length; shorter rows stay, and so does an untagged one of any length."""
    row = CpuCostModel.for_machine().softmax_loss_min_row
    mk = helper.make_node
    nodes = [mk("Softmax", [x], [y]) for x, y in (("x", "p"), ("y", "q"), ("u", "r"))]
    for node in nodes[:2]:
        entry = node.metadata_props.add()
        entry.key, entry.value = LOWERED_FROM, "SoftmaxCrossEntropyLoss"
    inputs = {"x": (F32, [3, row]), "y": (F32, [3, row - 1]), "u": (F32, [3, row])}
    proto, model = _graph(nodes, inputs, ["p", "q", "r"])
    assert lower_softmax(model) == 1
    by_out = {n.outputs[0].name: (n.domain, n.op_type) for n in model.graph}
    assert by_out == {"p": (CPU_DOMAIN, "Softmax"), "q": ("", "Softmax"), "r": ("", "Softmax")}
    rng = np.random.default_rng(6)
    _same_outputs(proto, model, {n: _f32(rng, tuple(s), 4.0) for n, (_, s) in inputs.items()})
    # the threshold moved by one: the shorter head moves too
    _, model = _graph(nodes, inputs, ["p", "q", "r"])
    assert lower_softmax(model, cost(softmax_loss_min_row=row - 1)) == 2


@pytest.mark.parametrize(
    "make,masked",
    [
        (lambda mk: [_const("m", MIN32), mk("Add", ["s", "m"], ["z"])], True),
        (lambda mk: [_const("m", -1e4), mk("Add", ["s", "m"], ["z"])], True),
        (lambda mk: [_const("m", float("-inf")), mk("Add", ["s", "m"], ["z"])], True),
        (lambda mk: [_const("m", BELOW_EXP / 2), mk("Add", ["s", "m"], ["z"])], False),
        # (1 - mask) * -10000, the older BERT spelling
        (lambda mk: [_const("one", 1.0), _const("big", -1e4), mk("Sub", ["one", "f"], ["inv"]),
                     mk("Mul", ["inv", "big"], ["m"]), mk("Add", ["s", "m"], ["z"])], True),
        (lambda mk: [_const("m", MIN32), mk("Expand", ["m", "shape"], ["e"]),
                     mk("Add", ["s", "e"], ["z"])], True),
        (lambda mk: [mk("Add", ["s", "f"], ["z"])], False),  # unknown values
        (lambda mk: [_const("m", 0.5), mk("Mul", ["s", "m"], ["z"])], False),
    ],
    ids=["finfo-min", "minus-1e4", "minus-inf", "above-exp-range", "scaled-mask", "expanded",
         "graph-input", "scaled-scores"],
)  # fmt: skip
def test_masked_logits_are_what_the_graph_shows(make, masked: bool) -> None:
    nodes = make(helper.make_node)
    shape_const = numpy_helper.from_array(np.array([2, 5], np.int64), "shape")
    nodes.insert(0, helper.make_node("Constant", [], ["shape"], value=shape_const))
    inputs = {"s": (F32, [2, 5]), "f": (F32, [2, 5])}
    _, model = _graph(nodes, inputs, ["z"])
    z = next(n.outputs[0] for n in model.graph if n.outputs[0].name == "z")
    assert can_hold_masked(z) is masked


def test_softmax_in_its_inputs_buffer() -> None:
    """The kernel offers Y in X's buffer (GetMayInplace): ONNX Runtime takes it when X dies
    there (a Relu's output here), and the result is the same as from a fresh buffer (the
    kernel against float64: the tests above)."""
    mk = helper.make_node
    nodes = [
        mk("Relu", ["x"], ["r"]),
        mk("Softmax", ["r", "bias"], ["p"], domain=CPU_DOMAIN),
        mk("Relu", ["y"], ["ry"]),
        mk("Softmax", ["ry"], ["q"], domain=CPU_DOMAIN),
    ]
    vis = [helper.make_tensor_value_info(n, F32, [6, 4100]) for n in ("x", "bias", "y")]
    outs = [helper.make_tensor_value_info(n, F32, None) for n in ("p", "q")]
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(CPU_DOMAIN, 1)]
    proto = helper.make_model(helper.make_graph(nodes, "g", vis, outs), opset_imports=opsets)
    so = ort.SessionOptions()
    so.register_custom_ops_library(_library())
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(8)
    feeds = {n: _f32(rng, (6, 4100), 4.0) for n in ("x", "bias", "y")}
    p, q = sess.run(None, feeds)
    # bit for bit what the kernel gives in a buffer of its own
    (alone_p,) = _run("Softmax", {"X": np.maximum(feeds["x"], 0), "bias": feeds["bias"]})
    (alone_q,) = _run("Softmax", {"X": np.maximum(feeds["y"], 0)})
    np.testing.assert_array_equal(p, alone_p)
    np.testing.assert_array_equal(q, alone_q)


def test_pass_on_opset_11_last_axis_only() -> None:
    mk = helper.make_node
    nodes = [
        _const("m", np.where(np.arange(7) > 4, MIN32, 0.0)),
        mk("Add", ["x", "m"], ["z"]),
        mk("Softmax", ["z"], ["p"]),  # opset 11's default axis 1 is the last of a 2-D input
        _const("m3", np.where(np.arange(4) > 2, MIN32, 0.0)),
        mk("Add", ["x3", "m3"], ["z3"]),
        mk("Softmax", ["z3"], ["p3"]),  # axis 1 of 3: flattens the last two axes
    ]
    inputs = {"x": (F32, [4, 7]), "x3": (F32, [2, 3, 4])}
    proto, model = _graph(nodes, inputs, ["p", "p3"], opset=11)
    assert lower_softmax(model) == 1
    rng = np.random.default_rng(5)
    feeds = {n: _f32(rng, tuple(s)) for n, (_, s) in inputs.items()}
    _same_outputs(proto, model, feeds)


# --------------------------------------------------------------------------- trainer graphs
def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=97, n_embd=32, n_layer=3, n_head=4, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


@pytest.mark.slow
def test_gpt2_attention_softmaxes_move_and_the_loss_softmax_stays() -> None:
    _library()
    model = _gpt2()
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = ORTTrainer(model, opt, TrainerOptions(cpu_kernels="ortrain"))
    trainer.train_step(input_ids=ids, labels=ids)
    graph = trainer.train_graphs[0].graph
    kernels = [n for n in graph if n.domain == CPU_DOMAIN and n.op_type == "Softmax"]
    # one per layer and its copy in the backward (recompute_attention.py), each with its
    # causal mask taken in
    assert len(kernels) == 6 and sum(n.name.endswith("/recompute") for n in kernels) == 3
    assert all(len(n.inputs) == 2 for n in kernels)
    standard = [n for n in graph if n.domain in ("", "ai.onnx") and n.op_type == "Softmax"]
    assert len(standard) == 1  # the cross-entropy's, over dense logits
    rec = next(r for r in trainer.build_log if r.graph == "train" and r.stage == "cpu_softmax")
    assert rec.op_delta.get(f"{CPU_DOMAIN}::Softmax") == 6
    assert rec.op_delta.get("Add") == -6
    # the eval graph moves them too, and computes the module's eval forward
    out = trainer.eval_step(input_ids=ids, labels=ids)
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-4, atol=1e-5)
    rec = next(r for r in trainer.build_log if r.graph == "eval" and r.stage == "cpu_softmax")
    assert rec.op_delta.get(f"{CPU_DOMAIN}::Softmax") == 3
