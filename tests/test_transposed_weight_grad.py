"""graph_passes/targets/cpu/transposed_weight_grad.py and the kernels it uses: ``AdamStep`` reading
its gradient transposed and ``ScatterAddColumns``, each held bit for bit to the
untransposed kernel; the pass on hand-built graphs (what it rewrites, what it leaves);
trainers whose weight gradients are made transposed (the size threshold lowered so that
small models have them) held to torch's kernels and to eager."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import ortrain.graph_passes.targets.cpu.transposed_weight_grad as twg
from ortrain.core.names import CPU_DOMAIN, HYPER_NAMES
from ortrain.graph_passes.targets.cpu.cost_model import COST_ENV
from tests.conftest import bert_batches, bert_mlm, gpt2, lm_batches
from tests.test_cpu_cost_model import cost
from tests.test_forward_kernels import train_against_eager
from tests.test_grad_kernels import _library
from tests.test_update_in_backward import _adamw, _hyper, _pair, _train_pair, untied_llama

F32, I64 = TensorProto.FLOAT, TensorProto.INT64
OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid(CPU_DOMAIN, 1)]


def _session(nodes, inputs, outputs, threads: int = 2) -> ort.InferenceSession:
    proto = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs), opset_imports=OPSETS)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.register_custom_ops_library(_library())
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


# ------------------------------------------------------------------ AdamStep transposed
def _adam(transposed: bool, arrays: dict[str, np.ndarray], threads: int = 2) -> float:
    """One AdamStep over ``arrays`` (P, G, M, V, H, L), P / M / V updated in place."""
    vis = [helper.make_tensor_value_info(n, F32, list(a.shape)) for n, a in arrays.items()]
    attrs = {"grad_transposed": 1} if transposed else {}
    node = helper.make_node(
        "AdamStep", ["P", "G", "M", "V", "H", "L"], ["done"], domain=CPU_DOMAIN, **attrs
    )
    sess = _session([node], vis, [helper.make_tensor_value_info("done", F32, [])], threads)
    binding = sess.io_binding()
    for name, a in arrays.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(a))
    binding.bind_output("done")
    sess.run_with_iobinding(binding)
    return float(binding.copy_outputs_to_cpu()[0])


def _adam_arrays(shape: tuple[int, int], seed: int, decoupled: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    p, g, m = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    v = rng.random(shape).astype(np.float32) * 0.1
    h = _hyper(1e-2, 0.05, 4, decoupled)
    return {"P": p, "G": g, "M": m, "V": v, "H": h, "L": np.array(1.5, dtype=np.float32)}


# one tile, ragged tiles (rows not a multiple of 16, columns past one 256-column tile)
@pytest.mark.parametrize("shape", [(1, 1), (16, 256), (37, 300), (70, 33), (5, 1000)], ids=str)
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("threads", [1, 3])
def test_adam_step_reads_a_transposed_gradient_bit_for_bit(
    shape: tuple[int, int], decoupled: bool, threads: int
) -> None:
    want = _adam_arrays(shape, seed=shape[0] * 7 + shape[1], decoupled=decoupled)
    got = {k: v.copy() for k, v in want.items()}
    got["G"] = np.ascontiguousarray(want["G"].T)
    assert _adam(False, want, threads) == 1.0
    assert _adam(True, got, threads) == 1.0
    before = _adam_arrays(shape, seed=shape[0] * 7 + shape[1], decoupled=decoupled)
    for k in ("P", "M", "V"):
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        assert not np.array_equal(got[k], before[k]), k  # it did update


def test_adam_step_transposed_skips_a_non_finite_loss_and_names_bad_shapes() -> None:
    arrays = _adam_arrays((20, 30), seed=1, decoupled=True)
    arrays["G"] = np.ascontiguousarray(arrays["G"].T)
    arrays["L"] = np.array(np.nan, dtype=np.float32)
    before = {k: v.copy() for k, v in arrays.items()}
    assert _adam(True, arrays) == 0.0
    for k in ("P", "M", "V"):
        np.testing.assert_array_equal(arrays[k], before[k])
    # a gradient of the parameter's own shape where its transpose is expected
    bad = _adam_arrays((20, 30), seed=1, decoupled=True)
    with pytest.raises(Exception, match=r"AdamStep: gradient G is \[20, 30\] but parameter P "
                       r"is \[20, 30\] \(grad_transposed"):  # fmt: skip
        _adam(True, bad)


# ---------------------------------------------------------------- ScatterAddColumns
def _scatter(op: str, base: np.ndarray, idx: np.ndarray, upd: np.ndarray, threads: int = 2):
    vis = [
        helper.make_tensor_value_info("base", F32, list(base.shape)),
        helper.make_tensor_value_info("idx", I64, list(idx.shape)),
        helper.make_tensor_value_info("upd", F32, list(upd.shape)),
    ]
    node = helper.make_node(op, ["base", "idx", "upd"], ["out"], domain=CPU_DOMAIN)
    out = [helper.make_tensor_value_info("out", F32, list(base.shape))]
    sess = _session([node], vis, out, threads)
    return sess.run(None, {"base": base, "idx": idx, "upd": upd})[0]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("width,vocab,n", [(8, 50, 30), (37, 1000, 300), (1, 5, 0)])
def test_scatter_add_columns_is_the_row_scatter_transposed(
    width: int, vocab: int, n: int, threads: int
) -> None:
    rng = np.random.default_rng(width + n)
    base = rng.standard_normal((vocab, width)).astype(np.float32)
    idx = rng.integers(-vocab, vocab, size=n).astype(np.int64)  # repeats, negative indices
    if n:
        idx[: n // 3] = idx[0]  # one row many times: the order of its sum matters
    upd = rng.standard_normal((n, width)).astype(np.float32)
    rows = _scatter("ScatterAddRows", base, idx, upd, threads)
    cols = _scatter("ScatterAddColumns", np.ascontiguousarray(base.T), idx, upd, threads)
    np.testing.assert_array_equal(cols, rows.T)
    want = base.copy()
    np.add.at(want, idx, upd)
    np.testing.assert_allclose(rows, want, rtol=1e-5, atol=1e-5)


def test_scatter_add_columns_errors_name_the_op_and_what() -> None:
    base = np.zeros((4, 10), np.float32)
    with pytest.raises(Exception, match=r"ScatterAddColumns: index 10 \(entry 1\) is out of "
                       r"range for 10 columns"):  # fmt: skip
        _scatter("ScatterAddColumns", base, np.array([0, 10]), np.zeros((2, 4), np.float32))
    with pytest.raises(Exception, match=r"ScatterAddColumns: updates \[2, 3\] do not hold one "
                       r"column of base \[4, 10\] per index \(cols \[2\]\)"):  # fmt: skip
        _scatter("ScatterAddColumns", base, np.array([0, 1]), np.zeros((2, 3), np.float32))
    with pytest.raises(Exception, match=r"ScatterAddColumns: base is \[40\]; expected 2-D"):
        _scatter("ScatterAddColumns", np.zeros(40, np.float32), np.array([0]),
                 np.zeros((1, 40), np.float32))  # fmt: skip


# ------------------------------------------------------------------- the pass, by hand
def _val(name: str, dims: list[int], dtype: ir.DataType = ir.DataType.FLOAT) -> ir.Value:
    return ir.Value(name=name, shape=ir.Shape(dims), type=ir.TensorType(dtype))


def _head_graph(
    vocab: int = 40, tied: bool = True, trans_b: int = 0, extra_reader: bool = False
) -> tuple[ir.Model, dict[str, ir.Node]]:
    """dW = Gemm(dY, X, transA=1) [-> ScatterAddRows] -> AdamStep: a head's update."""
    tokens, hidden = 6, 8
    dy = _val("dY", [tokens, vocab])
    x = _val("X", [hidden, tokens] if trans_b else [tokens, hidden])
    names = ["P", "M", "V"]
    p, m, v = (_val(n, [vocab, hidden]) for n in names)
    h, loss = _val("H", [len(HYPER_NAMES)]), _val("L", [])
    idx, rows = _val("idx", [tokens], ir.DataType.INT64), _val("rows", [tokens, hidden])
    inputs = [dy, x, p, m, v, h, loss, idx, rows]
    nodes: dict[str, ir.Node] = {}
    attrs = [ir.AttrInt64("transA", 1)] + ([ir.AttrInt64("transB", 1)] if trans_b else [])
    nodes["gemm"] = ir.Node("", "Gemm", [dy, x], attrs, num_outputs=1, name="gemm")
    dw = nodes["gemm"].outputs[0]
    dw.name, dw.shape, dw.type = "dW", ir.Shape([vocab, hidden]), ir.TensorType(ir.DataType.FLOAT)
    grad = dw
    if tied:
        nodes["scatter"] = ir.Node(CPU_DOMAIN, "ScatterAddRows", [dw, idx, rows], name="scatter")
        grad = nodes["scatter"].outputs[0]
        grad.name, grad.shape = "grad", ir.Shape([vocab, hidden])
        grad.type = ir.TensorType(ir.DataType.FLOAT)
    nodes["adam"] = ir.Node(CPU_DOMAIN, "AdamStep", [p, grad, m, v, h, loss], name="adam")
    done = nodes["adam"].outputs[0]
    done.name, done.shape, done.type = "done", ir.Shape([]), ir.TensorType(ir.DataType.FLOAT)
    outputs = [done]
    if extra_reader:
        nodes["norm"] = ir.Node("", "ReduceSumSquare", [dw], name="norm")
        nodes["norm"].outputs[0].name = "norm"
        outputs.append(nodes["norm"].outputs[0])
    graph = ir.Graph(inputs, outputs, nodes=list(nodes.values()), opset_imports={"": 17})
    return ir.Model(graph, ir_version=9), nodes


def _run_head(model: ir.Model, seed: int = 0) -> dict[str, np.ndarray]:
    """Runs the graph once on random data; P, M and V after the update."""
    rng = np.random.default_rng(seed)
    proto = ir.serde.serialize_model(model)
    proto.opset_import.append(helper.make_opsetid(CPU_DOMAIN, 1))
    so = ort.SessionOptions()
    so.register_custom_ops_library(_library())
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = {}
    for i in sess.get_inputs():
        if i.name == "idx":
            feeds[i.name] = rng.integers(0, 40, size=i.shape).astype(np.int64)  # rows of P
        elif i.name == "H":
            feeds[i.name] = _hyper(1e-2, 0.01, 2, True)
        elif i.name == "L":
            feeds[i.name] = np.array(1.0, dtype=np.float32)
        else:
            feeds[i.name] = rng.standard_normal(i.shape).astype(np.float32)
    binding = sess.io_binding()
    for name, a in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(a))
    for o in sess.get_outputs():
        binding.bind_output(o.name)
    sess.run_with_iobinding(binding)
    return {k: feeds[k] for k in ("P", "M", "V")}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_pass_makes_the_head_gradient_transposed_with_the_same_update(tied: bool) -> None:
    before = _run_head(_head_graph(tied=tied)[0])
    model, nodes = _head_graph(tied=tied)
    assert twg.transpose_weight_gradients(model, cost(transposed_grad_min_rows=32)) == 1
    gemm = nodes["gemm"]
    assert [v.name for v in gemm.inputs] == ["X", "dY"]
    assert gemm.attributes["transA"].value == 1
    assert list(gemm.outputs[0].shape.dims) == [8, 40]
    assert nodes["adam"].attributes["grad_transposed"].value == 1
    if tied:
        assert nodes["scatter"].op_type == "ScatterAddColumns"
        assert list(nodes["scatter"].outputs[0].shape.dims) == [8, 40]
    after = _run_head(model)
    for k in ("P", "M", "V"):  # the two products round differently: ~1 ulp of the sums
        np.testing.assert_allclose(after[k], before[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # nothing left to do
    assert twg.transpose_weight_gradients(model, cost(transposed_grad_min_rows=32)) == 0


@pytest.mark.parametrize(
    "kw,min_rows",
    [({}, 41), ({"trans_b": 1}, 32), ({"extra_reader": True}, 32)],
    ids=["below-threshold", "transB", "another-reader"],
)
def test_pass_leaves_what_it_cannot_rewrite(kw: dict, min_rows: int) -> None:
    model, nodes = _head_graph(**kw)
    assert twg.transpose_weight_gradients(model, cost(transposed_grad_min_rows=min_rows)) == 0
    assert [v.name for v in nodes["gemm"].inputs] == ["dY", "X"]
    assert nodes["scatter"].op_type == "ScatterAddRows"
    assert "grad_transposed" not in nodes["adam"].attributes


def test_pass_leaves_a_gradient_that_is_a_graph_output() -> None:
    model, nodes = _head_graph(tied=False)
    model.graph.outputs.append(nodes["gemm"].outputs[0])
    assert twg.transpose_weight_gradients(model, cost(transposed_grad_min_rows=32)) == 0


# ------------------------------------------------------------------------ in trainers
def _transposed(trainer) -> tuple[int, int]:
    graph = trainer.train_graphs[0].graph
    adam = [n for n in graph if n.op_type == "AdamStep" and "grad_transposed" in n.attributes]
    cols = [n for n in graph if n.op_type == "ScatterAddColumns"]
    return len(adam), len(cols)


@pytest.mark.slow
@pytest.mark.parametrize("vocab,want", [(16384, 1), (8192, 0)])
def test_default_threshold_takes_vocabulary_sized_tables_only(vocab: int, want: int) -> None:
    _library()
    model = gpt2(layers=1, hidden=32, vocab=vocab)
    a, b = _pair(model, _adamw)
    _train_pair(a, b, lm_batches(2, batch=2, seq=16, vocab=vocab))
    assert _transposed(a) == (want, want)


# every transA product (min_rows 1: per layer the four HF Conv1D weights, x^T dY, and the
# tied table), or the table alone (300 rows; the MLP's c_proj has 256)
@pytest.mark.slow
@pytest.mark.parametrize("min_rows,want", [(1, 9), (257, 1)], ids=["every-weight", "table"])
def test_gpt2_trains_like_torch_kernels_with_transposed_gradients(
    min_rows: int, want: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    _library()
    monkeypatch.setenv(COST_ENV, f"transposed_grad_min_rows={min_rows}")
    model = gpt2(layers=2, hidden=64, vocab=300)
    a, b = _pair(model, _adamw)
    _train_pair(a, b, lm_batches(3, vocab=300))
    assert _transposed(a) == (want, 1)  # the table's scatter adds into columns


@pytest.mark.slow
def test_bert_and_an_untied_llama_train_like_eager_with_transposed_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _library()
    # the 300-row tables, not the 256-row MLPs
    monkeypatch.setenv(COST_ENV, "transposed_grad_min_rows=257")
    model = bert_mlm(hidden=64, layers=2, vocab=300)
    trainer = train_against_eager(model, bert_batches(3, vocab=300), torch.optim.AdamW, lr=1e-3)
    assert trainer._in_backward and _transposed(trainer) == (1, 1)
    llama = untied_llama(vocab=300)
    trainer = train_against_eager(llama, lm_batches(3, vocab=300), torch.optim.Adam, lr=1e-3)
    # the untied head's weight (no scatter); the embedding table's gradient is a scatter
    # of zeros, not a product
    assert _transposed(trainer) == (1, 0)
