"""``ortrain.blas.BatchMatMul`` (``ortrain/runtime/blas_batch.c``) and ``blas_batch_matmul``.

- the op against numpy in float64 over every transpose / head-swap combination, rank 3
  and 4, through MKL's sgemm_batch and through the one-sgemm-per-matrix fallback;
- errors naming both operands' shapes;
- the pass on a hand-built attention block: the products move, the head Transposes fold
  into them, the graph computes what it did; what stays (a Transpose read elsewhere,
  broadcast batches, small products);
- training GPT-2 / BERT with it against eager.
"""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ortrain import TrainerOptions
from ortrain.core.names import BLAS_DOMAIN
from ortrain.graph_passes.targets.cpu.blas_batch_matmul import lower_batch_matmul
from ortrain.graph_passes.targets.cpu.cost_model import COST_ENV
from ortrain.runtime import cpu_ops
from tests.test_blas_gemm import _library
from tests.test_cpu_cost_model import cost
from tests.test_model_families import FAMILIES, NO_DROPOUT, Family, _batch, _trains_like_eager

F32 = TensorProto.FLOAT
MS = "com.microsoft"
EPS32 = float(np.finfo(np.float32).eps)


def _batch_library() -> str:
    lib = _library()
    if not cpu_ops.has_sgemm_batch():
        pytest.skip("torch's BLAS has no sgemm_batch (not MKL): the pass stays off")
    return lib


def _session(proto: onnx.ModelProto, lib: str) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.register_custom_ops_library(lib)
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _op_model(shape_a: list[int], shape_b: list[int], **attrs: object) -> onnx.ModelProto:
    node = helper.make_node("BatchMatMul", ["A", "B"], ["Y"], domain=BLAS_DOMAIN, **attrs)
    vis = [helper.make_tensor_value_info(n, F32, s) for n, s in (("A", shape_a), ("B", shape_b))]
    graph = helper.make_graph([node], "g", vis, [helper.make_tensor_value_info("Y", F32, None)])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(BLAS_DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _logical(x: np.ndarray, swap: int, trans: int) -> np.ndarray:
    """The stored operand as the matrices op() multiplies."""
    x = x.astype(np.float64)
    if swap:
        x = x.transpose(0, 2, 1, 3)
    return np.swapaxes(x, -1, -2) if trans else x


def _stored(b: int, h: int, rows: int, cols: int, swap: int, rng: np.random.Generator):
    shape = [b, rows, h, cols] if swap else ([b, h, rows, cols] if h else [b, rows, cols])
    return rng.standard_normal(shape).astype(np.float32)


def run_op(lib: str, a: np.ndarray, b: np.ndarray, batch_fn: str, **attrs: object) -> np.ndarray:
    """The op's Y on A, B; ``batch_fn="sgemm_loop"``: through the one-sgemm-per-matrix
    fallback (MKL's sgemm_batch handed back afterwards)."""
    handle = ctypes.CDLL(lib)
    handle.ortrain_blas_set_sgemm_batch.argtypes = [ctypes.c_void_p]
    if batch_fn == "sgemm_loop":
        handle.ortrain_blas_set_sgemm_batch(None)
    try:
        (y,) = _session(_op_model(list(a.shape), list(b.shape), **attrs), lib).run(
            None, {"A": a, "B": b}
        )
    finally:
        handle.ortrain_blas_set_sgemm_batch(cpu_ops._torch_blas()[1])
    return y


def expected(op_a: np.ndarray, op_b: np.ndarray, alpha: float, swap_y: int):
    """alpha op(A) op(B) in float64 and the magnitude its float32 roundoff scales with,
    both in Y's stored layout."""
    want, magnitude = alpha * op_a @ op_b, abs(alpha) * np.abs(op_a) @ np.abs(op_b)
    if swap_y:
        want, magnitude = want.transpose(0, 2, 1, 3), magnitude.transpose(0, 2, 1, 3)
    return want, magnitude


CASES = list(itertools.product([0, 1], repeat=5))  # transA, transB, swapA, swapB, swapY


@pytest.mark.parametrize("batch_fn", ["sgemm_batch", "sgemm_loop"])
@pytest.mark.parametrize(("ta", "tb", "sa", "sb", "sy"), CASES, ids=str)
def test_op_matches_float64(ta: int, tb: int, sa: int, sb: int, sy: int, batch_fn: str) -> None:
    lib = _batch_library()
    rng = np.random.default_rng(ta + 2 * tb + 4 * sa + 8 * sb + 16 * sy)
    b, h, m, k, n = 2, 3, 17, 9, 20  # ragged sizes: no dimension coincides
    a = _stored(b, h, *((k, m) if ta else (m, k)), sa, rng)
    bb = _stored(b, h, *((n, k) if tb else (k, n)), sb, rng)
    attrs = dict(transA=ta, transB=tb, swapA=sa, swapB=sb, swapY=sy, alpha=0.5)
    y = run_op(lib, a, bb, batch_fn, **attrs)
    want, magnitude = expected(_logical(a, sa, ta), _logical(bb, sb, tb), 0.5, sy)
    assert y.shape == want.shape
    assert np.all(np.abs(y - want) <= 2 * k * EPS32 * magnitude + 1e-30)


def test_rank_3_and_empty_products() -> None:
    lib = _batch_library()
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 7, 3)).astype(np.float32), rng.standard_normal((5, 3, 4))
    b = b.astype(np.float32)
    (y,) = _session(_op_model([5, 7, 3], [5, 3, 4]), lib).run(None, {"A": a, "B": b})
    np.testing.assert_allclose(y, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-6)
    zero_k = _session(_op_model([2, 3, 4, 0], [2, 3, 0, 5], swapY=1), lib)
    (y,) = zero_k.run(None, {"A": np.zeros((2, 3, 4, 0), np.float32), "B": np.zeros((2, 3, 0, 5),
                      np.float32)})  # fmt: skip
    assert y.shape == (2, 4, 3, 5) and not y.any()


def test_op_names_mismatched_shapes() -> None:
    lib = _batch_library()
    cases = [
        ([2, 3, 4, 5], [2, 4, 5, 6], {}, r"A \[2, 3, 4, 5\] \(transA=0\) and B \[2, 4, 5, 6\]"),
        ([2, 3, 4, 5], [2, 3, 6, 7], {}, "inner sizes agree"),
        ([2, 4, 5], [2, 5, 6], {"swapA": 1}, "3-D or 4-D"),
        ([1, 2, 3, 4, 5], [1, 2, 3, 5, 6], {}, "3-D or 4-D"),
    ]
    for sa, sb, attrs, message in cases:
        sess = _session(_op_model(sa, sb, **attrs), lib)
        feeds = {"A": np.zeros(sa, np.float32), "B": np.zeros(sb, np.float32)}
        with pytest.raises(Exception, match=rf"ortrain\.blas\.BatchMatMul: .*{message}"):
            sess.run(None, feeds)


# --------------------------------------------------------------------------- the pass
def _attention(b: int = 2, s: int = 16, h: int = 4, d: int = 8) -> onnx.ModelProto:
    """Q, K, V [b, s, h*d] -> softmax(Q K^T / sqrt(d)) V, heads split and merged by
    Transposes as torch.onnx exports them; ``k_heads`` is also an output (read elsewhere)."""
    mk = helper.make_node
    shape = helper.make_tensor("heads", TensorProto.INT64, [4], [b, s, h, d])
    flat = helper.make_tensor("flat", TensorProto.INT64, [3], [b, s, h * d])
    nodes = []
    for x in "qkv":
        nodes += [mk("Reshape", [x, "heads"], [f"{x}4"]),
                  mk("Transpose", [f"{x}4"], [f"{x}_heads"], perm=[0, 2, 1, 3])]  # fmt: skip
    nodes += [
        mk("FusedMatMul", ["q_heads", "k_heads"], ["scores"], domain=MS, transB=1,
           alpha=d**-0.5),
        mk("Softmax", ["scores"], ["probs"], axis=-1),
        mk("MatMul", ["probs", "v_heads"], ["ctx"]),
        mk("Transpose", ["ctx"], ["ctx4"], perm=[0, 2, 1, 3]),
        mk("Reshape", ["ctx4", "flat"], ["out"]),
        mk("MatMul", ["probs", "probs"], ["pp"]),  # [.., s, s] @ [.., s, s]: no Transpose
        mk("MatMul", ["probs", "v_one"], ["bcast"]),  # a broadcast batch: stays
    ]  # fmt: skip
    vis = [helper.make_tensor_value_info(x, F32, [b, s, h * d]) for x in "qkv"]
    vis.append(helper.make_tensor_value_info("v_one", F32, [b, 1, s, d]))
    names = ("out", "pp", "k_heads", "bcast")
    outs = [helper.make_tensor_value_info(n, F32, None) for n in names]
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]
    graph = helper.make_graph(nodes, "g", vis, outs, [shape, flat])
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=opsets))


def _typed(proto: onnx.ModelProto, b: int, s: int, h: int, d: int) -> ir.Model:
    """The model with the shapes ONNX's inference leaves out after the contrib op."""
    model = ir.serde.deserialize_model(proto)
    for node in model.graph:
        for v in node.outputs:
            if v.shape is None:
                square = v.name in ("scores", "probs", "pp")
                v.dtype, v.shape = ir.DataType.FLOAT, ir.Shape([b, h, s, s if square else d])
    return model


def test_pass_folds_head_transposes_into_the_products() -> None:
    lib = _batch_library()
    proto = _attention()
    model = _typed(proto, 2, 16, 4, 8)
    assert lower_batch_matmul(model, cost(batch_matmul_min_flops=0)) == 3
    ops = {n.outputs[0].name: n for n in model.graph}
    scores, ctx, pp = ops["scores"], ops["out"].inputs[0].producer(), ops["pp"]
    assert ctx is not None and ctx.op_type == "BatchMatMul" and ctx.domain == BLAS_DOMAIN
    attrs = {k: v.value for k, v in scores.attributes.items()}
    assert attrs == {"transA": 0, "transB": 1, "alpha": pytest.approx(8**-0.5), "swapA": 1,
                     "swapB": 1}  # fmt: skip
    assert {k: v.value for k, v in ctx.attributes.items()} == {"swapB": 1, "swapY": 1}
    assert pp.op_type == "BatchMatMul" and not pp.attributes
    assert ops["bcast"].op_type == "MatMul"
    transposes = [n.outputs[0].name for n in model.graph if n.op_type == "Transpose"]
    assert transposes == ["k_heads"]  # a graph output: kept (its product reads k4 now)
    rng = np.random.default_rng(1)
    feeds = {x: rng.standard_normal((2, 16, 32)).astype(np.float32) for x in "qkv"}
    feeds["v_one"] = rng.standard_normal((2, 1, 16, 8)).astype(np.float32)
    got = _session(ir.serde.serialize_model(model), lib).run(None, feeds)
    want = ort.InferenceSession(proto.SerializeToString()).run(None, feeds)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_pass_threshold_counts_flops() -> None:
    model = _typed(_attention(b=1, s=8, h=2, d=4), 1, 8, 2, 4)
    # Q K^T: 2 * 2 heads * 8 * 8 * 4 = 1024 flops; P V the same; P P: 2048
    assert lower_batch_matmul(model, cost(batch_matmul_min_flops=1025)) == 1
    assert lower_batch_matmul(model, cost(batch_matmul_min_flops=1024)) == 2


# --------------------------------------------------------------------------- training
MODELS = {
    "gpt2": Family(
        "GPT2LMHeadModel", "GPT2Config", "right",
        dict(n_embd=64, n_layer=2, n_head=4, n_positions=24, **NO_DROPOUT),
    ),
    "roberta": FAMILIES["roberta"],  # padding mask broadcast over heads
    "bart": FAMILIES["bart"],  # encoder, decoder and cross attention
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_trains_like_eager_with_batched_products_on_mkl(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _batch_library()
    monkeypatch.setenv(COST_ENV, "batch_matmul_min_flops=0")  # the forked build inherits it
    family = MODELS[name]
    g = torch.Generator().manual_seed(3)
    batches = [_batch(family.batch, g) for _ in range(3)]
    trainer = _trains_like_eager(family.build(), batches, options=TrainerOptions(cpu_gemm="blas"))
    train = next(
        r for r in trainer.build_log if r.graph == "train" and r.stage == "blas_batch_matmul"
    )
    # each attention: 2 forward + 4 backward products, their head Transposes gone
    assert train.op_delta.get(f"{BLAS_DOMAIN}::BatchMatMul", 0) >= 12, train.op_delta
    assert train.op_delta.get("Transpose", 0) <= -12, train.op_delta
    evals = [r for r in trainer.build_log if r.graph == "eval" and r.stage == "blas_batch_matmul"]
    assert evals and evals[0].op_delta.get(f"{BLAS_DOMAIN}::BatchMatMul", 0) >= 4
