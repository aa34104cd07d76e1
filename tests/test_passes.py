"""Graph passes: structure after the pass and numerical equivalence before/after."""

from __future__ import annotations

import collections

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ortrain.export import export_forward
from ortrain.graph_passes.cleanup.forward_cleanup import (
    CLEANUP_RULES,
    FOLD_OUTPUT_LIMIT,
    clean_forward,
)
from ortrain.graph_passes.fusions.gelu import fuse_gelu
from ortrain.graph_passes.fusions.lower_cross_entropy import lower_softmax_cross_entropy
from ortrain.graph_passes.prepare.dropout_seed import seed_dropouts
from tests.conftest import gpt2


def _run(model: ir.Model, feeds: dict) -> list[np.ndarray]:
    data = ir.serde.serialize_model(model).SerializeToString()
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)


def _ops(model: ir.Model) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph)


def _model(nodes, inputs, outputs, opset=20) -> ir.Model:
    g = helper.make_graph(nodes, "g", inputs, outputs)
    proto = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    proto.ir_version = 10
    return ir.serde.deserialize_model(proto)


@pytest.mark.slow
def test_fuse_gelu_on_exported_gpt2_keeps_outputs():
    model = gpt2(layers=3, hidden=64, vocab=64)
    ids = torch.randint(0, 64, (2, 8))
    ex = export_forward(model, {"input_ids": ids, "labels": ids}, train=False)
    feeds = {n: p.detach().numpy() for n, p in model.named_parameters()}
    feeds.update(input_ids=ids.numpy(), labels=ids.numpy())
    feeds = {v.name: feeds[v.name] for v in ex.model.graph.inputs}
    before = _run(ex.model, feeds)
    assert _ops(ex.model)["Tanh"] == 3
    assert fuse_gelu(ex.model) == 3
    ops = _ops(ex.model)
    assert ops["Gelu"] == 3 and ops["Tanh"] == 0 and ops["Pow"] == 0
    after = _run(ex.model, feeds)
    np.testing.assert_allclose(after[0], before[0], rtol=1e-5)


@pytest.mark.parametrize("form", ["div", "mul", "commuted"])
def test_fuse_gelu_erf_forms(form):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])
    c = [
        helper.make_node("Constant", [], ["half"], value_float=0.5),
        helper.make_node("Constant", [], ["one"], value_float=1.0),
        helper.make_node("Constant", [], ["s"], value_float=2**0.5 if form != "mul" else 2**-0.5),
    ]
    scaled = helper.make_node("Mul" if form == "mul" else "Div", ["x", "s"], ["xs"])
    half = (
        helper.make_node("Mul", ["half", "x"], ["hx"])
        if form == "commuted"
        else helper.make_node("Mul", ["x", "half"], ["hx"])
    )
    nodes = [
        *c,
        scaled,
        helper.make_node("Erf", ["xs"], ["e"]),
        helper.make_node("Add", ["one", "e"] if form == "commuted" else ["e", "one"], ["a"]),
        half,
        helper.make_node("Mul", ["hx", "a"], ["y"]),
    ]
    model = _model(nodes, [x], [y])
    feeds = {"x": np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)}
    before = _run(model, feeds)[0]
    assert fuse_gelu(model) == 1
    assert _ops(model)["Gelu"] == 1 and _ops(model)["Erf"] == 0
    np.testing.assert_allclose(_run(model, feeds)[0], before, rtol=1e-5, atol=1e-6)
    assert fuse_gelu(model) == 0  # nothing left to do: not modified


def _sce_model(
    rank: int,
    with_log_prob: bool,
    *,
    log_prob_readers: tuple[str, ...] = (),
    weights: bool = False,
    ignore_index: int | None = -100,
    reduction: str = "mean",
    dtype: int = TensorProto.FLOAT,
) -> ir.Model:
    """SoftmaxCrossEntropyLoss; its log_prob a graph output (``with_log_prob``) and/or
    read by ``log_prob_readers`` (unary ops, each output ``r<i>`` a graph output)."""
    shape = [6, 10] if rank == 2 else [6, 10, 3]
    x = helper.make_tensor_value_info("x", dtype, shape)
    lab = helper.make_tensor_value_info("l", TensorProto.INT64, [shape[0], *shape[2:]])
    inputs = [x, lab]
    loss_shape = [] if reduction != "none" else [shape[0], *shape[2:]]
    outs = [helper.make_tensor_value_info("loss", dtype, loss_shape)]
    names = ["loss"]
    if with_log_prob or log_prob_readers:
        names.append("lp")
    if with_log_prob:
        outs.append(helper.make_tensor_value_info("lp", dtype, shape))
    if weights:
        inputs.append(helper.make_tensor_value_info("w", dtype, [shape[1]]))
    attrs = {"reduction": reduction}
    if ignore_index is not None:
        attrs["ignore_index"] = ignore_index
    node = helper.make_node("SoftmaxCrossEntropyLoss", [v.name for v in inputs], names, **attrs)
    nodes = [node]
    for i, op in enumerate(log_prob_readers):
        nodes.append(helper.make_node(op, ["lp"], [f"r{i}"]))
        outs.append(helper.make_tensor_value_info(f"r{i}", dtype, shape))
    return _model(nodes, inputs, outs)


def _sce_feeds(model: ir.Model, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, 6)
    labels[2] = -100
    feeds = {"x": rng.standard_normal((6, 10)).astype(np.float32), "l": labels}
    if "w" in {v.name for v in model.graph.inputs}:
        feeds["w"] = rng.uniform(0.5, 2.0, 10).astype(np.float32)
    return feeds


def _lowered_matches(model: ir.Model, feeds: dict) -> collections.Counter:
    before = _run(model, feeds)
    names = [v.name for v in model.graph.outputs]
    assert lower_softmax_cross_entropy(model) == 1
    assert [v.name for v in model.graph.outputs] == names
    after = _run(model, feeds)
    for a, b in zip(after, before, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    return _ops(model)


_SOFTMAX_FORM = {"Softmax": 1, "GatherElements": 1, "ReduceMax": 2, "Log": 1, "Unsqueeze": 1}
_SOFTMAX_FORM.update(Sub=1, Add=1, Squeeze=1, Neg=1)
# The NLL of the picked entries in stock ops, per (ignore_index given, reduction).
_NLL_OPS = {
    (True, "mean"): {"Equal": 1, "Where": 2, "Not": 1, "Cast": 1, "ReduceSum": 2, "Div": 1},
    (True, "sum"): {"Equal": 1, "Where": 2, "ReduceSum": 1},
    (True, "none"): {"Equal": 1, "Where": 2},
    (False, "mean"): {"ReduceMean": 1},
    (False, "sum"): {"ReduceSum": 1},
    (False, "none"): {},
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [-100, None])
def test_lower_cross_entropy_softmax_form(reduction, ignore_index):
    """No log_prob reader: Softmax, the labelled entries gathered, their NLL in stock ops
    (no NegativeLogLikelihoodLoss: ONNX Runtime's CUDA provider has no kernel for it)."""
    model = _sce_model(2, False, ignore_index=ignore_index, reduction=reduction)
    feeds = _sce_feeds(model)
    if ignore_index is None:
        feeds["l"][2] = 7
    ops = _lowered_matches(model, feeds)
    expected = {**_SOFTMAX_FORM, **_NLL_OPS[ignore_index is not None, reduction]}
    assert ops == collections.Counter(expected)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_lower_cross_entropy_class_weights(reduction):
    """Class weights: each row weighs its label's weight; ignored rows weigh 0 in the mean."""
    model = _sce_model(2, False, weights=True, reduction=reduction)
    ops = _lowered_matches(model, _sce_feeds(model))
    assert ops["Gather"] == 1 and ops["LogSoftmax"] == 1 and ops["NegativeLogLikelihoodLoss"] == 0
    assert ops["Mul"] == 1 and ops["Where"] == 3  # index, loss, weight


def test_lower_cross_entropy_all_rows_ignored_is_nan_like_onnx():
    model = _sce_model(2, False, reduction="mean")
    feeds = _sce_feeds(model)
    feeds["l"][:] = -100
    before = _run(model, feeds)[0]
    assert lower_softmax_cross_entropy(model) == 1
    after = _run(model, feeds)[0]
    assert np.isnan(before) and np.isnan(after)


def test_lower_cross_entropy_exp_of_log_prob_reads_the_softmax():
    """The gradient rule's Exp(log_prob) becomes the Softmax output: no [N, C] log-prob."""
    model = _sce_model(2, False, log_prob_readers=("Exp", "Exp"))
    ops = _lowered_matches(model, _sce_feeds(model))
    assert ops["Exp"] == 0 and ops["LogSoftmax"] == 0 and ops["Softmax"] == 1
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    for out in model.graph.outputs[1:]:  # graph outputs keep their names through an Identity
        assert out.producer().op_type == "Identity"
        assert out.producer().inputs[0].producer() is softmax


def test_lower_cross_entropy_backward_exp_reads_the_softmax():
    """Exp(log_prob) inside the graph (the gradient rule's): its readers read the Softmax."""
    model = _sce_model(2, False, log_prob_readers=("Exp",))
    out = model.graph.outputs[1]
    neg = ir.Node("", "Neg", [out.producer().outputs[0]], name="reader")
    model.graph.append(neg)
    neg.outputs[0].name, neg.outputs[0].dtype = "neg", ir.DataType.FLOAT
    neg.outputs[0].shape = ir.Shape([6, 10])
    model.graph.outputs[1] = neg.outputs[0]
    ops = _lowered_matches(model, _sce_feeds(model))
    assert ops["Exp"] == 0 and ops["Identity"] == 0
    assert neg.inputs[0].producer().op_type == "Softmax"


@pytest.mark.parametrize(
    "case",
    [
        dict(with_log_prob=True),  # log_prob is a graph output
        dict(with_log_prob=False, log_prob_readers=("Exp", "Neg")),  # another reader
        dict(with_log_prob=False, weights=True),  # class weights
    ],
    ids=["log_prob_output", "other_reader", "weights"],
)
def test_lower_cross_entropy_log_softmax_form(case):
    model = _sce_model(2, **case)
    ops = _lowered_matches(model, _sce_feeds(model))
    assert ops["LogSoftmax"] == 1 and ops["GatherElements"] == 1
    assert ops["NegativeLogLikelihoodLoss"] == 0
    assert ops["Softmax"] == 0 and ops["SoftmaxCrossEntropyLoss"] == 0


def test_lower_cross_entropy_half_scores_keep_log_softmax():
    model = _sce_model(2, False, dtype=TensorProto.FLOAT16)
    assert lower_softmax_cross_entropy(model) == 1
    assert _ops(model)["LogSoftmax"] == 1 and _ops(model)["Softmax"] == 0


def test_lower_cross_entropy_underflowing_probability_keeps_the_row_loss():
    """A logit gap past fp32's range: the row's loss is the gap (logsumexp - x[t]), not
    -log of the underflowed probability."""
    model = _sce_model(2, False, reduction="none")
    feeds = _sce_feeds(model)
    feeds["x"][0] = 0.0
    feeds["x"][0, (feeds["l"][0] + 1) % 10] = 200.0  # the label's probability is exp(-200)
    before = _run(model, feeds)[0]
    assert lower_softmax_cross_entropy(model) == 1
    after = _run(model, feeds)[0]
    np.testing.assert_allclose(before[0], 200.0, rtol=1e-6)
    np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)


def test_lower_cross_entropy_leaves_3d_alone():
    model = _sce_model(3, True)
    assert lower_softmax_cross_entropy(model) == 0
    assert _ops(model) == collections.Counter({"SoftmaxCrossEntropyLoss": 1})


def test_seed_dropouts_gives_distinct_reproducible_seeds():
    def build():
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
        nodes = [
            helper.make_node("Dropout", ["x"], ["a"]),
            helper.make_node("Dropout", ["a"], ["y"]),
        ]
        return _model(nodes, [x], [y])

    m1, m2, m3 = build(), build(), build()
    assert seed_dropouts(m1, 5) == 2 and seed_dropouts(m2, 5) == 2 and seed_dropouts(m3, 6) == 2
    s1 = [n.attributes["seed"].value for n in m1.graph]
    assert s1 == [n.attributes["seed"].value for n in m2.graph]
    assert s1 != [n.attributes["seed"].value for n in m3.graph]
    assert len(set(s1)) == 2
    assert seed_dropouts(m1, 7) == 0  # existing seeds are kept


@pytest.mark.parametrize("ta,tb", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_fold_transpose_into_gemm(ta, tb):
    from ortrain.graph_passes.cleanup.fold_transpose_gemm import fold_transpose_into_gemm

    m, k, n = 3, 4, 5
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [k, m] if ta else [m, k])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, [n, k] if tb else [k, n])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, m])
    nodes = [
        helper.make_node("Gemm", ["a", "b"], ["g"], transA=ta, transB=tb, alpha=0.5),
        helper.make_node("Transpose", ["g"], ["y"], perm=[1, 0]),
    ]
    model = _model(nodes, [a, b], [y])
    rng = np.random.default_rng(3)
    feeds = {
        "a": rng.standard_normal([k, m] if ta else [m, k]).astype(np.float32),
        "b": rng.standard_normal([n, k] if tb else [k, n]).astype(np.float32),
    }
    before = _run(model, feeds)[0]
    assert fold_transpose_into_gemm(model) == 1
    assert _ops(model) == collections.Counter({"Gemm": 1})
    np.testing.assert_allclose(_run(model, feeds)[0], before, rtol=1e-6, atol=1e-6)


def test_fold_transpose_keeps_gemm_with_other_uses_or_bias():
    from ortrain.graph_passes.cleanup.fold_transpose_gemm import fold_transpose_into_gemm

    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [3, 4])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, [4, 5])
    c = helper.make_tensor_value_info("c", TensorProto.FLOAT, [5])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 3])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [3, 5])
    shared = _model(
        [helper.make_node("Gemm", ["a", "b"], ["z"]), helper.make_node("Transpose", ["z"], ["y"])],
        [a, b],
        [y, z],
    )
    assert fold_transpose_into_gemm(shared) == 0
    biased = _model(
        [
            helper.make_node("Gemm", ["a", "b", "c"], ["g"]),
            helper.make_node("Transpose", ["g"], ["y"]),
        ],
        [a, b, c],
        [y],
    )
    assert fold_transpose_into_gemm(biased) == 0


def _cleanup_model(mask_rows: int) -> ir.Model:
    """x [2, 6] -> reshape to [3, 4] through Shape arithmetic, plus a constant
    subexpression, two identical Exps, a dead Relu, two seeded Dropouts on one input,
    and an Expand-ed constant mask of mask_rows x 1024 elements."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])
    m = helper.make_tensor_value_info("m", TensorProto.FLOAT, [mask_rows, 1024])
    i64 = lambda name, v: helper.make_node(  # noqa: E731
        "Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(v)], v)
    )
    nodes = [
        helper.make_node("Shape", ["x"], ["shp"]),
        i64("start", [1]), i64("end", [2]), i64("three", [3]), i64("mshape", [mask_rows, 1024]),
        helper.make_node("Slice", ["shp", "start", "end"], ["six"]),
        helper.make_node("Div", ["six", "three"], ["two"]),
        helper.make_node("Mul", ["two", "two"], ["four"]),
        helper.make_node("Concat", ["three", "four"], ["newshape"], axis=0),
        helper.make_node("Reshape", ["x", "newshape"], ["r"]),
        helper.make_node("Constant", [], ["c"], value_float=1.5),
        helper.make_node("Add", ["c", "c"], ["c2"]),
        helper.make_node("Mul", ["r", "c2"], ["s"]),
        helper.make_node("Exp", ["s"], ["e1"]),
        helper.make_node("Exp", ["s"], ["e2"]),
        helper.make_node("Relu", ["s"], ["dead"]),
        helper.make_node("Constant", [], ["ratio"], value_float=0.5),
        helper.make_node("Constant", [], ["train"],
                         value=helper.make_tensor("t", TensorProto.BOOL, [], [True])),
        helper.make_node("Dropout", ["e1", "ratio", "train"], ["d1"], seed=1),
        helper.make_node("Dropout", ["e2", "ratio", "train"], ["d2"], seed=2),
        helper.make_node("Sub", ["d1", "d2"], ["y"]),
        helper.make_node("Expand", ["c", "mshape"], ["m"]),
    ]  # fmt: skip
    return _model(nodes, [x], [y, m])


def test_clean_forward_folds_shape_arithmetic_merges_and_drops_dead_code():
    model = _cleanup_model(mask_rows=4)
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 6)).astype(np.float32)}
    before = _run(model, feeds)
    clean_forward(model)
    ops = _ops(model)
    # Shape arithmetic and the constant Add are now initializers; Reshape reads one.
    for op in ("Shape", "Slice", "Div", "Concat", "Add", "Relu", "Expand"):
        assert ops[op] == 0, (op, ops)
    reshape = next(n for n in model.graph if n.op_type == "Reshape")
    assert reshape.inputs[1].const_value.numpy().tolist() == [3, 4]
    assert "x" in [v.name for v in model.graph.inputs]  # inputs are never folded
    assert ops["Exp"] == 1  # CSE merged the identical Exps
    assert ops["Dropout"] == 2  # differently seeded Dropouts are never merged
    after = _run(model, feeds)
    for a, b in zip(after, before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_clean_forward_keeps_large_constants_computed():
    rows = FOLD_OUTPUT_LIMIT // 1024 + 1
    model = _cleanup_model(mask_rows=rows)
    clean_forward(model)
    assert _ops(model)["Expand"] == 1
    assert all(v.const_value is None or v.const_value.size <= FOLD_OUTPUT_LIMIT
               for v in model.graph.initializers.values())  # fmt: skip


@pytest.mark.parametrize("eps", [1e-12, 1e-9, -1e-10])
def test_clean_forward_keeps_tiny_constants_and_drops_exact_identities(eps):
    # onnxscript's no-op rules match x + 0 within abs_tol 1e-8: a LayerNorm's 1e-12 eps
    # vanished and a zero variance divided by zero. Exact identities still go.
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    const = lambda name, v: helper.make_node(  # noqa: E731
        "Constant", [], [name], value=helper.make_tensor(name, TensorProto.FLOAT, [], [v])
    )
    nodes = [
        const("eps", eps), const("zero", 0.0), const("one", 1.0),
        helper.make_node("Mul", ["x", "x"], ["sq"]),
        helper.make_node("Add", ["sq", "eps"], ["v"]),
        helper.make_node("Add", ["zero", "v"], ["v0"]),
        helper.make_node("Mul", ["v0", "one"], ["v1"]),
        helper.make_node("Sub", ["v1", "zero"], ["v2"]),
        helper.make_node("Div", ["v2", "one"], ["v3"]),
        helper.make_node("Reciprocal", ["v3"], ["y"]),
    ]  # fmt: skip
    model = _model(nodes, [x], [y])
    clean_forward(model)
    ops = _ops(model)
    assert ops["Add"] == 1 and ops["Sub"] == 0 and ops["Div"] == 0 and ops["Mul"] == 1, ops
    feeds = {"x": np.zeros((2, 3), np.float32)}
    np.testing.assert_array_equal(_run(model, feeds)[0], np.float32(1) / np.float32(eps))


def test_clean_forward_refuses_unseeded_dropout():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    model = _model([helper.make_node("Dropout", ["x"], ["y"], name="drop0")], [x], [y])
    with pytest.raises(ValueError, match=r"drop0.*seed_dropouts"):
        clean_forward(model)


# --------------------------------------------------------------------------- pad_as_concat
def _pad_model(dtype, shape, pads, value=None, axes=None, mode=None) -> ir.Model:
    x = helper.make_tensor_value_info("x", dtype, shape)
    y = helper.make_tensor_value_info("y", dtype, None)
    inits = [helper.make_tensor("pads", TensorProto.INT64, [len(pads)], pads)]
    names = ["x", "pads"]
    if value is not None or axes is not None:
        names.append("value" if value is not None else "")
        if value is not None:
            inits.append(helper.make_tensor("value", dtype, [], [value]))
    if axes is not None:
        names.append("axes")
        inits.append(helper.make_tensor("axes", TensorProto.INT64, [len(axes)], axes))
    attrs = {"mode": mode} if mode else {}
    g = helper.make_graph([helper.make_node("Pad", names, ["y"], **attrs)], "g", [x], [y], inits)
    proto = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
    proto.ir_version = 10
    return ir.serde.deserialize_model(proto)


@pytest.mark.parametrize(
    "dtype, pads, value, axes, concats",
    [
        (TensorProto.INT64, [0, 0, 0, 1], -100, None, 1),  # GPT-2's labels: one column after
        (TensorProto.INT64, [1, 2, 3, 0], 7, None, 2),  # both axes, before and after
        (TensorProto.INT32, [2, 1], None, [-1], 1),  # axes input, default value 0
        (TensorProto.BOOL, [1, 0, 0, 0], None, None, 1),
        (TensorProto.INT64, [0, 0, 0, 0], 5, None, 0),  # nothing to pad: an Identity
    ],
)
def test_pad_as_concat_rewrites_integer_pads(dtype, pads, value, axes, concats):
    from ortrain.graph_passes.cleanup.pad_as_concat import pad_as_concat

    model = _pad_model(dtype, [3, 4], pads, value, axes)
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    feeds = {"x": np.random.default_rng(0).integers(0, 9, (3, 4)).astype(np_dtype)}
    before = _run(model, feeds)[0]
    assert pad_as_concat(model) == 1
    expected = {"Concat": concats} if concats else {"Identity": 1}
    assert _ops(model) == collections.Counter(expected)
    assert model.graph.outputs[0].name == "y"
    assert list(model.graph.outputs[0].shape.dims) == list(before.shape)
    after = _run(model, feeds)[0]
    assert after.dtype == before.dtype and np.array_equal(after, before)


@pytest.mark.parametrize(
    "dtype, pads, mode",
    [
        (TensorProto.FLOAT, [0, 0, 0, 1], None),  # CUDA has a float Pad
        (TensorProto.INT64, [0, 0, 0, -1], None),  # cropping
        (TensorProto.INT64, [0, 0, 0, 1], "edge"),
    ],
)
def test_pad_as_concat_leaves_other_pads(dtype, pads, mode):
    from ortrain.graph_passes.cleanup.pad_as_concat import pad_as_concat

    model = _pad_model(dtype, [3, 4], pads, mode=mode)
    assert pad_as_concat(model) == 0
    assert _ops(model) == collections.Counter(Pad=1)


@pytest.mark.slow
def test_gpt2_training_graph_has_no_pad():
    """GPT-2's int64 label Pad would run on the CPU under ONNX Runtime's CUDA provider."""
    from ortrain import ORTTrainer, TrainerOptions
    from tests.conftest import lm_batches

    model = gpt2(layers=1, hidden=32, vocab=64)
    ex = export_forward(model, lm_batches(1, vocab=64, batch=2, seq=8)[0], train=True)
    assert _ops(ex.model)["Pad"] == 1
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions())
    trainer.train_step(**lm_batches(1, vocab=64, batch=2, seq=8)[0])
    record = next(r for r in trainer.build_log if r.stage == "pad_as_concat")
    assert record.op_delta == {"Pad": -1, "Concat": 1}


# --------------------------------------------------------------------- masked_attention_rows
def _sdpa_probs_model(lowest: float, keep: float = 0.0, dtype=TensorProto.FLOAT) -> ir.Model:
    """torch.onnx's SDPA with a boolean mask: Where(mask, 0, lowest) + scores, Softmax,
    then the NaN guard Where(IsNaN(p), 0, p)."""
    shape = [2, 3, 4, 5]
    nodes = [
        helper.make_node("Where", ["mask", "keep", "lowest"], ["bias"]),
        helper.make_node("Add", ["scores", "bias"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["p"], axis=-1),
        helper.make_node("IsNaN", ["p"], ["nan"]),
        helper.make_node("Where", ["nan", "zero", "p"], ["y"]),
    ]
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    inits = [
        helper.make_tensor("keep", dtype, [], [keep]),
        helper.make_tensor("lowest", dtype, [], [np.asarray(lowest, np_dtype).item()]),
        helper.make_tensor("zero", dtype, [], [0.0]),
    ]
    g = helper.make_graph(
        nodes,
        "sdpa",
        [
            helper.make_tensor_value_info("scores", dtype, shape),
            helper.make_tensor_value_info("mask", TensorProto.BOOL, [2, 1, 4, 5]),
        ],
        [helper.make_tensor_value_info("y", dtype, shape)],
        inits,
    )
    proto = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
    proto.ir_version = 10
    return ir.serde.deserialize_model(proto)


def _sdpa_feeds(np_dtype=np.float32) -> dict:
    rng = np.random.default_rng(0)
    mask = rng.random((2, 1, 4, 5)) < 0.6
    mask[0, 0, 1] = False  # fully masked query rows
    mask[1, 0, 3] = False
    mask[1, 0, 0] = True
    return {"scores": rng.standard_normal((2, 3, 4, 5)).astype(np_dtype), "mask": mask}


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16])
def test_masked_attention_rows_give_zero_like_torch_sdpa(dtype):
    from ortrain.graph_passes.prepare.masked_attention_rows import fix_masked_attention_rows

    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    model = _sdpa_probs_model(float(np.finfo(np_dtype).min), dtype=dtype)
    feeds = _sdpa_feeds(np_dtype)
    scores, mask = torch.from_numpy(feeds["scores"]).float(), torch.from_numpy(feeds["mask"])
    # torch's SDPA weights: softmax over the kept keys, 0 in rows with none kept.
    expected = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
    before = _run(model, feeds)[0]
    # The exported graph attends to every key in those rows (the bug the pass fixes):
    # uniformly in float32, where the bias swamps the scores.
    np.testing.assert_allclose(before[0, :, 1].astype(np.float32).sum(-1), 1.0, rtol=1e-3)
    if dtype == TensorProto.FLOAT:
        np.testing.assert_allclose(before[0, :, 1], 0.2, rtol=1e-6)
    assert fix_masked_attention_rows(model) == 1
    ops = _ops(model)
    assert ops["IsNaN"] == 0 and ops["ReduceMax"] == 1 and ops["Less"] == 1
    after = _run(model, feeds)[0]
    tol = 1e-6 if dtype == TensorProto.FLOAT else 1e-3
    np.testing.assert_allclose(after.astype(np.float32), expected.numpy(), rtol=tol, atol=tol)
    assert not after[0, :, 1].any() and not after[1, :, 3].any()


@pytest.mark.parametrize("lowest, keep", [(-1e4, 0.0), (float(np.finfo(np.float32).min), 1.0)])
def test_masked_attention_rows_leave_other_masks(lowest, keep):
    """A finite bias that does not swamp the scores, or a non-zero 'keep' value, is not
    torch.onnx's boolean SDPA mask: the guard stays."""
    from ortrain.graph_passes.prepare.masked_attention_rows import fix_masked_attention_rows

    model = _sdpa_probs_model(lowest, keep)
    assert fix_masked_attention_rows(model) == 0
    assert _ops(model)["IsNaN"] == 1


# ------------------------------------------------------------------------------ pow_as_mul
def _pow_model(exponent: float, x_shape, e_shape=(), dtype=TensorProto.FLOAT) -> ir.Model:
    e_dtype = TensorProto.FLOAT if isinstance(exponent, float) else TensorProto.INT64
    inits = [helper.make_tensor("e", e_dtype, list(e_shape), [exponent])]
    g = helper.make_graph(
        [helper.make_node("Pow", ["x", "e"], ["y"]), helper.make_node("Neg", ["y"], ["z"])],
        "pow",
        [helper.make_tensor_value_info("x", dtype, list(x_shape))],
        [helper.make_tensor_value_info("z", dtype, None)],
        inits,
    )
    proto = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
    proto.ir_version = 10
    return ir.serde.deserialize_model(proto)


@pytest.mark.parametrize("exponent, muls", [(2.0, 1), (3.0, 2), (2, 1)])
def test_pow_as_mul_rewrites_squares_and_cubes(exponent, muls):
    from ortrain.graph_passes.cleanup.pow_as_mul import pow_as_mul

    model = _pow_model(exponent, [3, 5])
    feeds = {"x": np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)}
    before = _run(model, feeds)[0]
    assert pow_as_mul(model) == 1
    assert _ops(model) == collections.Counter(Mul=muls, Neg=1)
    after = _run(model, feeds)[0]
    if exponent == 3.0:  # two roundings instead of one
        np.testing.assert_allclose(after, before, rtol=2e-7, atol=0)
    else:
        assert np.array_equal(after, before)


@pytest.mark.parametrize(
    "exponent, x_shape, e_shape, dtype",
    [
        (2.5, [3, 5], (), TensorProto.FLOAT),  # not a small integer power
        (0.5, [3, 5], (), TensorProto.FLOAT),  # sqrt differs from pow at -0 and -inf
        (2.0, [], (1,), TensorProto.FLOAT),  # the exponent broadcasts a scalar x to [1]
        (2, [3, 5], (), TensorProto.INT64),  # integer base
    ],
)
def test_pow_as_mul_leaves_other_pows(exponent, x_shape, e_shape, dtype):
    from ortrain.graph_passes.cleanup.pow_as_mul import pow_as_mul

    model = _pow_model(exponent, x_shape, e_shape, dtype)
    assert pow_as_mul(model) == 0
    assert _ops(model)["Pow"] == 1


class _Rotary(torch.nn.Module):
    """Llama's ``rotate_half`` on two projections: the halves cut by two Slices each."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    @staticmethod
    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = x.cos(), x.sin()
        q, k = self.q(x), self.k(x)
        return ((q * cos + self.rotate_half(q) * sin) * (k * cos + self.rotate_half(k) * sin)).sum()


def test_cleanup_rules_match_one_node_each_and_lose_nothing_of_slices_split(monkeypatch):
    """Every cleanup rule has one output node: onnxscript's two-output patterns (its
    SlicesSplit) are matched by trying every node against every other, re-indexing the
    graph for each (a 2,200-node chunked linear attention spent minutes there). Left
    out, SlicesSplit changes nothing on exported rotary halves (the exporter's Slices
    carry steps and an open end, which it does not match)."""
    from onnxscript.rewriter.rules.common import _basic_rules

    from ortrain.graph_passes.cleanup import export_cleanup

    assert all(r._target_pattern.has_single_output_node for r in CLEANUP_RULES)
    raw = torch.onnx.export(_Rotary(), (torch.randn(3, 16),), dynamo=True, optimize=False).model
    with_rule = ir.serde.deserialize_model(ir.serde.serialize_model(raw))
    export_cleanup.clean_export(raw)
    monkeypatch.setattr(
        export_cleanup, "CLEANUP_RULES", (*CLEANUP_RULES, _basic_rules.slice_split_rule)
    )
    export_cleanup.clean_export(with_rule)
    assert _ops(raw) == _ops(with_rule)
    assert _ops(raw)["Slice"] == 4 and _ops(raw)["Split"] == 0
