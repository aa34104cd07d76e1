"""graph_passes/targets/cpu/transposed_activations.py and the kernels' ``out_transposed`` outputs:
LayerNorm's Y, the GELUs' and GELU backwards' outputs and Mul / Add / Sub written
transposed, held bit for bit to the plain kernels; the pass on hand-built graphs (what
it rewrites, what it leaves); trainers whose products read transposed activations held
to eager, and the token counts it leaves alone."""

from __future__ import annotations

import copy

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import ortrain.graph_passes.training_pipeline as tp
from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.names import CPU_DOMAIN, HYPER_NAMES
from ortrain.graph_passes.infra.tags import ORDERING_INPUTS_FROM
from ortrain.graph_passes.targets.cpu.cost_model import COST_ENV, CpuCostModel, CpuFacts
from ortrain.graph_passes.targets.cpu.transposed_activations import write_activations_transposed
from tests.conftest import bert_batches, bert_mlm, gpt2, lm_batches
from tests.test_forward_kernels import train_against_eager
from tests.test_grad_kernels import _library
from tests.test_update_in_backward import _adamw, _pair, _train_pair

F32 = TensorProto.FLOAT
OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid(CPU_DOMAIN, 1)]


def _run(node: helper.NodeProto, feeds: dict[str, np.ndarray], threads: int = 2) -> list:
    inputs = [helper.make_tensor_value_info(n, F32, list(a.shape)) for n, a in feeds.items()]
    outputs = [helper.make_tensor_value_info(o, F32, None) for o in node.output if o]
    graph = helper.make_graph([node], "g", inputs, outputs)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.register_custom_ops_library(_library())
    proto = helper.make_model(graph, opset_imports=OPSETS)
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _t2d(a: np.ndarray) -> np.ndarray:
    """The transpose of ``a``'s 2-D view [rows, last axis]."""
    return np.ascontiguousarray(a.reshape(-1, a.shape[-1]).T)


# ragged everywhere: rows not a multiple of 16 (a block) or 8 (a register transpose),
# columns past one 256-column tile and not a multiple of 8; 3-D inputs flatten
SHAPES = [(1, 1), (16, 256), (37, 300), (3, 7, 33), (70, 1000)]


# ----------------------------------------------------------------------- kernels
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("form", ["bias", "no-bias", "skip", "skip+sum"])
@pytest.mark.parametrize("threads", [1, 3])
def test_layer_norm_writes_y_transposed_bit_for_bit(shape, form: str, threads: int) -> None:
    rng = np.random.default_rng(sum(shape))
    cols = shape[-1]
    feeds = {
        "X": rng.standard_normal(shape).astype(np.float32) * 3 + 1,
        "scale": rng.standard_normal(cols).astype(np.float32),
    }
    inputs = ["X", "scale"]
    if form != "no-bias":
        feeds["bias"] = rng.standard_normal(cols).astype(np.float32)
        inputs.append("bias")
    outputs = ["Y", "mean", "inv_std"]
    if form.startswith("skip"):
        feeds["skip"] = rng.standard_normal(shape).astype(np.float32)
        inputs += [""] * (3 - len(inputs)) + ["skip"]
        if form == "skip+sum":
            outputs.append("sum")

    def run(**attrs: int) -> list:
        node = helper.make_node("LayerNorm", inputs, outputs, domain=CPU_DOMAIN, **attrs)
        return _run(node, {k: v for k, v in feeds.items()}, threads)

    plain, transposed = run(), run(out_transposed=1)
    assert transposed[0].shape == (cols, int(np.prod(shape[:-1])))
    np.testing.assert_array_equal(transposed[0], _t2d(plain[0]))
    for want, got in zip(plain[1:], transposed[1:], strict=True):  # stats, sum: unchanged
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("op", ["GeluGrad", "FastGeluGrad"])
@pytest.mark.parametrize("bits", [1, 2, 3], ids=["dX", "Y", "both"])
@pytest.mark.parametrize("threads", [1, 3])
def test_gelu_backwards_write_outputs_transposed_bit_for_bit(
    shape, op: str, bits: int, threads: int
) -> None:
    rng = np.random.default_rng(len(shape) * 100 + shape[-1])
    feeds = {
        "dY": rng.standard_normal(shape).astype(np.float32),
        "X": rng.standard_normal(shape).astype(np.float32) * 2,
    }
    plain = _run(helper.make_node(op, ["dY", "X"], ["dX", "Y"], domain=CPU_DOMAIN), feeds, threads)
    node = helper.make_node(op, ["dY", "X"], ["dX", "Y"], domain=CPU_DOMAIN, out_transposed=bits)
    got = _run(node, feeds, threads)
    for i in range(2):
        np.testing.assert_array_equal(got[i], _t2d(plain[i]) if bits >> i & 1 else plain[i])
    if bits == 1:  # dX alone, no Y asked for
        node = helper.make_node(op, ["dY", "X"], ["dX"], domain=CPU_DOMAIN, out_transposed=1)
        np.testing.assert_array_equal(_run(node, feeds, threads)[0], _t2d(plain[0]))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("op", ["Gelu", "FastGelu"])
@pytest.mark.parametrize("threads", [1, 3])
def test_gelus_write_y_transposed_bit_for_bit(shape, op: str, threads: int) -> None:
    x = np.random.default_rng(shape[-1]).standard_normal(shape).astype(np.float32) * 2
    (plain,) = _run(helper.make_node(op, ["X"], ["Y"], domain=CPU_DOMAIN), {"X": x}, threads)
    node = helper.make_node(op, ["X"], ["Y"], domain=CPU_DOMAIN, out_transposed=1)
    (transposed,) = _run(node, {"X": x}, threads)
    np.testing.assert_array_equal(transposed, _t2d(plain))


# same shape, a per-row scale ([rows, 1]: the loss's row coefficients), a row vector, a
# broadcast middle axis, a scalar
BROADCASTS = [
    ((37, 300), (37, 300)),
    ((70, 33), (70, 1)),
    ((16, 256), (256,)),
    ((3, 7, 33), (3, 1, 33)),
    ((5, 1000), ()),
]


@pytest.mark.parametrize("shapes", BROADCASTS, ids=str)
@pytest.mark.parametrize("op", ["Mul", "Add", "Sub"])
@pytest.mark.parametrize("threads", [1, 3])
def test_binary_ops_write_y_transposed_bit_for_bit(shapes, op: str, threads: int) -> None:
    rng = np.random.default_rng(len(shapes[1]) * 1000 + shapes[0][-1])
    feeds = {
        "A": rng.standard_normal(shapes[0]).astype(np.float32),
        "B": np.asarray(rng.standard_normal(shapes[1]), dtype=np.float32),
    }
    (plain,) = _run(helper.make_node(op, ["A", "B"], ["Y"], domain=CPU_DOMAIN), feeds, threads)
    node = helper.make_node(op, ["A", "B"], ["Y"], domain=CPU_DOMAIN, out_transposed=1)
    (transposed,) = _run(node, feeds, threads)
    np.testing.assert_array_equal(transposed, _t2d(plain))


def test_gelu_backward_marking_y_needs_the_y_output() -> None:
    feeds = {"dY": np.ones((4, 8), np.float32), "X": np.ones((4, 8), np.float32)}
    node = helper.make_node(
        "FastGeluGrad", ["dY", "X"], ["dX"], domain=CPU_DOMAIN, out_transposed=2
    )
    with pytest.raises(Exception, match=r"FastGeluGrad: out_transposed marks Y, which is not"):
        _run(node, feeds)


# ------------------------------------------------------------------ the pass, by hand
def _val(name: str, dims: list[int]) -> ir.Value:
    return ir.Value(name=name, shape=ir.Shape(dims), type=ir.TensorType(ir.DataType.FLOAT))


def _out(node: ir.Node, i: int, name: str, dims: list[int]) -> ir.Value:
    v = node.outputs[i]
    v.name, v.shape, v.type = name, ir.Shape(dims), ir.TensorType(ir.DataType.FLOAT)
    return v


def _weight_grad_graph(
    kernel: str = "LayerNorm",
    batch: int = 3,
    seq: int = 5,
    reshape: bool = True,
    other_reader: bool = False,
    output_index: int | None = None,
    ordering_reader: bool = False,
    ordering_tag: bool = True,
    trans_a: int = 1,
    hidden: int = 12,
) -> tuple[ir.Model, dict[str, ir.Node]]:
    """kernel -> [Reshape to 2-D ->] Gemm(X, dY, transA=1) = dW: a weight gradient; or
    (``trans_a=0``) Gemm(X, W), a layer's product."""
    out = 20
    dims = [batch, seq, hidden] if reshape else [batch * seq, hidden]
    x = _val("x", dims)
    dy = _val("dY", [batch * seq, out]) if trans_a else _val("W", [hidden, out])
    nodes: dict[str, ir.Node] = {}
    inputs = [x, dy]
    if kernel == "Mul":  # a per-row scale (sink_row_scale.py's, on the head's input)
        rows = _val("rows", [*dims[:-1], 1])
        inputs.append(rows)
        nodes["kernel"] = ir.Node(CPU_DOMAIN, "Mul", [x, rows], name="kernel")
        index = 0
    elif kernel == "FastGelu":
        nodes["kernel"] = ir.Node(CPU_DOMAIN, "FastGelu", [x], name="kernel")
        index = 0
    elif kernel == "LayerNorm":
        scale, bias = _val("scale", [hidden]), _val("bias", [hidden])
        inputs += [scale, bias]
        nodes["kernel"] = ir.Node(CPU_DOMAIN, "LayerNorm", [x, scale, bias], name="kernel")
        index = 0
    else:
        dgelu = _val("dgelu", dims)
        inputs.append(dgelu)
        nodes["kernel"] = ir.Node(CPU_DOMAIN, kernel, [dgelu, x], num_outputs=2, name="kernel")
        index = 1
    index = index if output_index is None else output_index
    act = _out(nodes["kernel"], index, "act", dims)
    other = None
    if kernel.endswith("GeluGrad"):
        other = _out(nodes["kernel"], 1 - index, "other_out", dims)
    operand = act
    if reshape:
        shape = ir.Value(name="shape", const_value=ir.tensor(np.array([-1, hidden], np.int64)))
        nodes["reshape"] = ir.Node("", "Reshape", [act, shape], name="reshape")
        operand = _out(nodes["reshape"], 0, "act2d", [batch * seq, hidden])
    attrs = [ir.AttrInt64("transA", trans_a)]
    nodes["gemm"] = ir.Node("", "Gemm", [operand, dy], attrs, name="gemm")
    outputs = [_out(nodes["gemm"], 0, "dW", [hidden if trans_a else batch * seq, out])]
    if other is not None:
        outputs.append(other)
    if other_reader:
        nodes["other"] = ir.Node("", "Relu", [act], name="other")
        outputs.append(_out(nodes["other"], 0, "relu", dims))
    if ordering_reader:  # an update that must run after the kernel read its parameter
        h, loss = _val("H", [len(HYPER_NAMES)]), _val("L", [])
        p, g, m, v = (_val(n, [hidden]) for n in ("P", "G", "M", "V"))
        inputs += [p, g, m, v, h, loss]
        tag = {ORDERING_INPUTS_FROM: "6"} if ordering_tag else {}  # as update_in_backward.py
        nodes["adam"] = ir.Node(
            CPU_DOMAIN, "AdamStep", [p, g, m, v, h, loss, act], name="adam", metadata_props=tag
        )
        outputs.append(_out(nodes["adam"], 0, "done", []))
    graph = ir.Graph(inputs, outputs, nodes=list(nodes.values()), opset_imports={"": 17})
    if reshape:
        graph.initializers["shape"] = shape
    return ir.Model(graph, ir_version=9), nodes


def _run_graph(model: ir.Model, seed: int = 0) -> dict[str, np.ndarray]:
    proto = ir.serde.serialize_model(model)
    proto.opset_import.append(helper.make_opsetid(CPU_DOMAIN, 1))
    so = ort.SessionOptions()
    so.register_custom_ops_library(_library())
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in sess.get_inputs():
        if i.name == "H":
            feeds[i.name] = np.array([1e-2, 0.9, 0.999, 1e-8, 0.0, 1, 1], np.float32)
        else:
            feeds[i.name] = rng.standard_normal(i.shape).astype(np.float32)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds), strict=True))


@pytest.mark.parametrize(
    "kw",
    [
        {"kernel": "LayerNorm"},
        {"kernel": "LayerNorm", "reshape": False},
        {"kernel": "FastGeluGrad"},
        {"kernel": "GeluGrad", "reshape": False},
        {"kernel": "LayerNorm", "ordering_reader": True},
        {"kernel": "Mul", "reshape": False},
        {"kernel": "FastGeluGrad", "output_index": 0},
        # a plain product from rows 4 KiB apart (L1-aliased): transA reads them packed
        {"kernel": "FastGelu", "trans_a": 0, "hidden": 1024},
    ],
    ids=[
        "layer-norm",
        "layer-norm-2d",
        "fast-gelu-grad",
        "gelu-grad-2d",
        "update-after",
        "mul",
        "gelu-grad-dx",
        "aliased-plain-product",
    ],
)
def test_pass_has_the_kernel_write_the_operand_transposed(kw: dict) -> None:
    before = _run_graph(_weight_grad_graph(**kw)[0])
    model, nodes = _weight_grad_graph(**kw)
    assert write_activations_transposed(model) == 1
    kernel, gemm = nodes["kernel"], nodes["gemm"]
    index = kw.get("output_index", 1 if kw["kernel"].endswith("GeluGrad") else 0)
    assert kernel.attributes["out_transposed"].value == 1 << index
    act = kernel.outputs[index]
    assert list(act.shape.dims) == [kw.get("hidden", 12), 15]
    assert gemm.inputs[0] is act
    assert gemm.attributes["transA"].value == 1 - kw.get("trans_a", 1)
    assert "reshape" not in [n.name for n in model.graph]
    after = _run_graph(model)
    assert after.keys() == before.keys()
    for k, want in before.items():  # the products round differently: ~1 ulp of the sums
        np.testing.assert_allclose(after[k], want, rtol=1e-5, atol=1e-5, err_msg=k)
    assert write_activations_transposed(model) == 0  # nothing left to do


@pytest.mark.parametrize(
    "kw",
    [
        {"batch": 16, "seq": 64},  # 1024 rows: one page between rows of X^T
        {"other_reader": True},
        {"kernel": "FastGelu", "trans_a": 0},  # a plain product, rows not aliased: loses
        # an AdamStep input the graph does not state to be ordering-only reads the data
        {"kernel": "LayerNorm", "ordering_reader": True, "ordering_tag": False},
    ],
    ids=["page-aliased-rows", "another-reader", "plain-product", "untagged-update-input"],
)
def test_pass_leaves_what_it_should_not_rewrite(kw: dict) -> None:
    model, nodes = _weight_grad_graph(**kw)
    assert write_activations_transposed(model) == 0
    assert "out_transposed" not in nodes["kernel"].attributes
    assert nodes["gemm"].attributes["transA"].value == kw.get("trans_a", 1)


@pytest.mark.parametrize(
    "kw",
    [{"batch": 16, "seq": 64}, {"kernel": "FastGelu", "trans_a": 0, "hidden": 1024}],
    ids=["rows-4k-apart", "plain-product-4k-rows"],
)
def test_the_aliasing_stride_comes_from_the_l1_cache(kw: dict) -> None:
    """Rows 4 KiB apart alias on a 48 KiB 12-way L1 (a 4 KiB way) but not on a 64 KiB
    8-way one (an 8 KiB way): the decision follows the machine's facts."""
    four_k = CpuCostModel.for_machine(CpuFacts(l1d_bytes=48 * 1024, l1d_ways=12))
    eight_k = CpuCostModel.for_machine(CpuFacts(l1d_bytes=64 * 1024, l1d_ways=8))
    assert (four_k.aliasing_stride, eight_k.aliasing_stride) == (4096, 8192)
    plain = kw.get("trans_a", 1) == 0
    # 4 KiB way: transposed rows alias (left alone) / the plain A aliases (rewritten)
    assert write_activations_transposed(_weight_grad_graph(**kw)[0], four_k) == int(plain)
    # 8 KiB way: nothing aliases: the transA product gains, the plain one would lose
    assert write_activations_transposed(_weight_grad_graph(**kw)[0], eight_k) == int(not plain)


def test_pass_leaves_an_operand_that_is_a_graph_output() -> None:
    model, nodes = _weight_grad_graph(reshape=False)
    model.graph.outputs.append(nodes["kernel"].outputs[0])
    assert write_activations_transposed(model) == 0


# ------------------------------------------------------------------------ in trainers
def _transposed(trainer) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in trainer.train_graphs[0].graph:
        if "out_transposed" in n.attributes:
            counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


def test_gpt2_trains_like_eager_with_transposed_activations() -> None:
    _library()
    model = gpt2(layers=2, hidden=64, vocab=128)
    batches = lm_batches(3, vocab=128)  # 4 x 32 = 128 rows
    trainer = train_against_eager(model, batches, torch.optim.AdamW, lr=1e-3)
    # per layer: ln_1 and ln_2 (recomputed for c_attn's and c_fc's weight gradients) and
    # the GELU value for c_proj's; the final LayerNorm feeds the tied head's dW = dY^T X,
    # whose left operand is the logits' gradient
    assert _transposed(trainer) == {"LayerNorm": 4, "FastGeluGrad": 2}
    gemms = [n for n in trainer.train_graphs[0].graph if n.op_type == "Gemm"]
    assert sum(n.attributes.get("transA", ir.AttrInt64("transA", 0)).value for n in gemms) == 3


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 2], ids=["step", "accumulate-2"])
def test_gpt2_odd_shapes_train_like_eager_with_transposed_activations(accumulate: int) -> None:
    """111 rows (3 x 37), SGD; micro-batches accumulated into one step."""
    _library()
    model = gpt2(layers=2, hidden=48, vocab=200)
    batches = lm_batches(2 * accumulate, batch=3, seq=37, vocab=200)
    options = TrainerOptions(cpu_kernels="ortrain", grad_accumulation_steps=accumulate)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.3), options)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.3)
    for i, batch in enumerate(batches):
        trainer.train_step(**batch)
        (ref(**batch).loss / accumulate).backward()
        if (i + 1) % accumulate == 0:
            ref_opt.step()
            ref_opt.zero_grad()
    trainer.sync_to_module()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=2e-5, msg=name)
    assert _transposed(trainer) == {"LayerNorm": 4, "FastGeluGrad": 2}


def test_a_transposed_head_gradient_reads_its_scaled_input_transposed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tied head's dW^T = Gemm(c * X, dY, transA=1) (transposed_weight_grad.py; its
    threshold lowered to this 300-row table, above the 256-row MLP): the row-scaled input
    sink_row_scale.py made, on ortrain's Mul kernel (elementwise.py's threshold
    lowered to its 8192 elements), is written transposed too. Adam in the backward
    against torch's kernels (eager Adam would amplify rounding noise of ~0 gradients)."""
    _library()
    monkeypatch.setenv(COST_ENV, "transposed_grad_min_rows=257,elementwise_min_elements=4096")
    model = gpt2(layers=1, hidden=64, vocab=300)
    a, b = _pair(model, _adamw)
    _train_pair(a, b, lm_batches(3, vocab=300))
    assert _transposed(a) == {"LayerNorm": 2, "FastGeluGrad": 1, "Mul": 1}


@pytest.mark.slow
def test_an_aliased_mlp_width_reads_its_gelus_transposed() -> None:
    """An MLP 1024 wide (rows 4 KiB apart): the forward's GELU output (the projection's
    A) and the GELU backward's dX (the next product's A, the weight gradient's and the
    bias gradient's B) are written transposed too."""
    _library()
    model = gpt2(layers=2, hidden=256, vocab=128)
    trainer = train_against_eager(model, lm_batches(2, vocab=128), torch.optim.SGD, lr=0.3)
    graph = trainer.train_graphs[0].graph
    bits = {
        n.op_type: n.attributes["out_transposed"].value
        for n in graph
        if "out_transposed" in n.attributes
    }
    assert _transposed(trainer) == {"LayerNorm": 4, "FastGelu": 2, "FastGeluGrad": 2}
    assert bits["FastGeluGrad"] == 3 and bits["FastGelu"] == 1


@pytest.mark.slow
def test_bert_linear_weight_gradients_have_no_activation_operand() -> None:
    """nn.Linear's dW = dY^T X: the transA operand is the output's gradient, which the
    input's gradient reads too, so BERT at a 256-wide intermediate has no site; it trains
    as before. At 1024 the GELU's output and the GELU backward's dX (both read plainly
    from rows 4 KiB apart) are written transposed."""
    _library()
    big = bert_mlm(hidden=256, layers=1, vocab=300)
    big_trainer = train_against_eager(big, bert_batches(2, vocab=300), torch.optim.SGD, lr=0.3)
    assert _transposed(big_trainer) == {"Gelu": 1, "GeluGrad": 1}
    _library()
    model = bert_mlm(hidden=64, layers=2, vocab=300)
    trainer = train_against_eager(model, bert_batches(2, vocab=300), torch.optim.AdamW, lr=1e-3)
    assert _transposed(trainer) == {}


def test_page_aliased_token_counts_keep_the_transposed_product() -> None:
    _library()
    model = gpt2(layers=1, hidden=64, vocab=128)
    batches = lm_batches(2, batch=16, seq=64, vocab=128)  # 1024 rows
    trainer = train_against_eager(model, batches, torch.optim.AdamW, lr=1e-3)
    assert _transposed(trainer) == {}


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_the_pass_runs_last_in_cpu_kernel_builds_only(cpu_kernels: bool) -> None:
    """Without ortrain's kernels no ``out_transposed`` can be asked for; with them it runs
    after every pass that could still move a product or its operand."""
    passes = tp.build_pipeline(
        tp.BuildConfig(cpu_kernels=cpu_kernels), tp.BuildInputs("loss"), tp.BuildProducts()
    )
    names = [p.name for p in passes if isinstance(p, tp.Pass)]  # the serialized ones: after
    assert ("transposed_activations" in names) == cpu_kernels
    if cpu_kernels:
        assert names[-1] == "transposed_activations"
