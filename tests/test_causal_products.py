"""``triA`` on ``ortrain.blas.BatchMatMul`` and the ``causal_products`` pass.

- the op: a triangular op(A) against float64, over transposes and head swaps, sizes
  below, at and above the 64-row block, sgemm_batch and the per-matrix fallback; NaN
  placed 64 or more off the diagonal, where no block reads, must not reach the result
  (so a kernel that ignored triA fails);
- the op's errors (non-square op(A), a bad triA);
- the pass on hand-built attention graphs: the four products of P and dS marked, and
  nothing under a mask that is not a constant causal one;
- GPT-2 (S = 80: two blocks and a ragged one) trained against eager with the products
  marked, and a padded batch (And-ed mask) leaving them dense.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper

from ortrain import TrainerOptions
from ortrain.core.names import BLAS_DOMAIN, CPU_DOMAIN
from ortrain.graph_passes.targets.cpu.causal_products import mark_causal_products
from ortrain.graph_passes.targets.cpu.cost_model import COST_ENV
from tests.test_blas_batch_matmul import (
    _batch_library,
    _logical,
    _op_model,
    _session,
    _stored,
    expected,
    run_op,
)
from tests.test_model_families import NO_DROPOUT, Family, _trains_like_eager

F32 = TensorProto.FLOAT
EPS32 = float(np.finfo(np.float32).eps)
LOWEST = float(np.finfo(np.float32).min)


def _triangle(x: np.ndarray, tri: int) -> np.ndarray:
    return np.tril(x) if tri == 1 else np.triu(x)


def _poisoned(x: np.ndarray, tri: int) -> np.ndarray:
    """``x``'s triangle, zeros next to it, NaN 64 or more past the diagonal (the blocks
    a triangular product skips)."""
    s = x.shape[-1]
    i, j = np.indices((s, s))
    beyond = (j - i if tri == 1 else i - j) >= 64
    return np.where(beyond, np.float32(np.nan), _triangle(x, tri)).astype(np.float32)


# --------------------------------------------------------------------------- the op
CASES = list(itertools.product([1, 2], [0, 1], [0, 1], [0, 1], [40, 64, 150]))


@pytest.mark.parametrize("batch_fn", ["sgemm_batch", "sgemm_loop"])
@pytest.mark.parametrize(("tri", "ta", "tb", "swap", "s"), CASES, ids=str)
def test_triangular_op_multiplies_the_triangle(
    tri: int, ta: int, tb: int, swap: int, s: int, batch_fn: str
) -> None:
    lib = _batch_library()
    rng = np.random.default_rng(tri + 2 * ta + 4 * tb + 8 * swap + s)
    b, h, n = 2, 3, 20
    a = _stored(b, h, s, s, swap, rng)
    # op(A) = tri(L): with A stored transposed and/or heads swapped, poison in that layout
    logical = _poisoned(_logical(a, swap, ta).astype(np.float32), tri)
    if ta:
        logical = np.swapaxes(logical, -1, -2)
    a = np.ascontiguousarray(logical.transpose(0, 2, 1, 3) if swap else logical)
    bb = _stored(b, h, *((n, s) if tb else (s, n)), swap, rng)
    attrs = dict(transA=ta, transB=tb, swapA=swap, swapB=swap, swapY=swap, alpha=0.5, triA=tri)
    y = run_op(lib, a, bb, batch_fn, **attrs)
    op_a = np.nan_to_num(_logical(a, swap, ta), nan=0.0)
    want, magnitude = expected(op_a, _logical(bb, swap, tb), 0.5, swap)
    assert y.shape == want.shape and (s <= 64 or np.isnan(a).any())
    assert np.all(np.abs(y - want) <= 2 * s * EPS32 * magnitude + 1e-30)  # NaN fails too


def test_triangular_op_rank_3() -> None:
    lib = _batch_library()
    rng = np.random.default_rng(0)
    a = _poisoned(rng.standard_normal((3, 130, 130)).astype(np.float32), 2)
    b = rng.standard_normal((3, 130, 7)).astype(np.float32)
    (y,) = _session(_op_model([3, 130, 130], [3, 130, 7], triA=2), lib).run(None, {"A": a, "B": b})
    want = np.nan_to_num(a.astype(np.float64), nan=0.0) @ b
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)


def test_triangular_op_errors() -> None:
    lib = _batch_library()
    sess = _session(_op_model([2, 3, 8, 9], [2, 3, 9, 4], triA=1), lib)
    feeds = {"A": np.zeros((2, 3, 8, 9), np.float32), "B": np.zeros((2, 3, 9, 4), np.float32)}
    with pytest.raises(Exception, match=r"triA=1 needs a square op\(A\), got 8 x 9"):
        sess.run(None, feeds)
    with pytest.raises(Exception, match="triA must be 0, 1 or 2, got 3"):
        _session(_op_model([2, 8, 8], [2, 8, 4], triA=3), lib).run(
            None, {"A": np.zeros((2, 8, 8), np.float32), "B": np.zeros((2, 8, 4), np.float32)}
        )


# --------------------------------------------------------------------------- the pass
def _graph(mask: str = "causal", dropout: bool = False, std_softmax: bool = False) -> ir.Model:
    """One attention head block as the CPU training build leaves it: scores, a masked
    Softmax, P @ V, and the backward's SoftmaxGrad and four products."""
    b, h, s, d = 2, 2, 8, 4
    mk = helper.make_node
    causal = np.tril(np.ones((1, 1, s, s), dtype=bool))
    inits = [helper.make_tensor("zero", F32, [], [0.0]),
             helper.make_tensor("lowest", F32, [], [LOWEST]),
             helper.make_tensor("shape", TensorProto.INT64, [4], [b, 1, s, s])]  # fmt: skip
    if mask == "not_causal":
        causal[..., 0, 1] = True
    if mask == "diagonal_masked":
        causal[..., 3, 3] = False
    inits.append(onnx.numpy_helper.from_array(causal, "tri"))
    nodes = [mk("Expand", ["tri", "shape"], ["cond"])]
    if mask == "padded":  # And-ed with a padding mask: a fully masked row is not triangular
        nodes.append(mk("And", ["cond", "pad"], ["cond2"]))
    cond = "cond2" if mask == "padded" else "cond"
    if mask.startswith("additive"):  # a float constant added as is
        additive = np.where(causal, np.float32(0.5), np.float32(LOWEST)).astype(np.float32)
        if mask == "additive_diagonal_masked":
            additive[..., 3, 3] = LOWEST
        inits.append(onnx.numpy_helper.from_array(additive, "bias"))
    else:
        nodes.append(mk("Where", [cond, "zero", "lowest"], ["bias"]))
    mm = dict(domain=BLAS_DOMAIN)
    nodes.append(mk("BatchMatMul", ["q", "k"], ["scores"], transB=1, **mm))
    if std_softmax:
        nodes += [mk("Add", ["scores", "bias"], ["masked"]), mk("Softmax", ["masked"], ["p0"])]
    else:
        nodes.append(mk("Softmax", ["scores", "bias"], ["p0"], domain=CPU_DOMAIN))
    p = "p0"
    if dropout:
        nodes.append(mk("Dropout", ["p0", "ratio", "training"], ["p", "keep"]))
        p = "p"
    nodes += [
        mk("BatchMatMul", [p, "v"], ["ctx"], **mm),
        mk("BatchMatMul", [p, "d_ctx"], ["d_v"], transA=1, **mm),
        mk("BatchMatMul", ["d_ctx", "v"], ["d_p"], transB=1, **mm),
        mk("SoftmaxGrad", ["d_p", "p0"], ["d_s"], domain=CPU_DOMAIN),
        mk("BatchMatMul", ["d_s", "k"], ["d_q"], **mm),
        mk("BatchMatMul", ["d_s", "q"], ["d_k"], transA=1, **mm),
        mk("BatchMatMul", ["v", "d_s"], ["b_side"], transB=1, **mm),  # dS as B: left dense
    ]
    if dropout:
        inits += [helper.make_tensor("ratio", F32, [], [0.1]),
                  helper.make_tensor("training", TensorProto.BOOL, [], [True])]  # fmt: skip
    heads, square = [b, h, s, d], [b, h, s, s]
    inputs = [helper.make_tensor_value_info(n, F32, heads) for n in ("q", "k", "v", "d_ctx")]
    if mask == "padded":
        inputs.append(helper.make_tensor_value_info("pad", TensorProto.BOOL, [b, 1, 1, s]))
    outputs = [helper.make_tensor_value_info(n, F32, None) for n in
               ("ctx", "d_v", "d_q", "d_k", "b_side")]  # fmt: skip
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(BLAS_DOMAIN, 1),
              helper.make_opsetid(CPU_DOMAIN, 1)]  # fmt: skip
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=opsets))
    for node in model.graph:  # the shapes shape inference cannot give the custom ops
        for out in node.outputs:
            if out.shape is None:
                sq = out.name in ("scores", "p0", "p", "d_p", "d_s", "masked", "keep")
                mask_shape = [b, 1, s, s] if out.name in ("cond", "cond2", "bias") else None
                out.shape = ir.Shape(mask_shape or (square if sq else heads))
                boolean = out.name in ("keep", "cond", "cond2")
                out.dtype = ir.DataType.BOOL if boolean else ir.DataType.FLOAT
    return model


def _tri(model: ir.Model) -> dict[str, int]:
    return {
        n.outputs[0].name: n.attributes.get_int("triA", 0)
        for n in model.graph
        if n.op_type == "BatchMatMul"
    }


MARKED = {"scores": 0, "ctx": 1, "d_v": 2, "d_p": 0, "d_q": 1, "d_k": 2, "b_side": 0}


@pytest.mark.parametrize(
    "kw",
    [{}, {"dropout": True}, {"std_softmax": True}, {"mask": "additive"}],
    ids=["cpu", "dropout", "std", "additive"],
)
def test_pass_marks_the_products_of_p_and_its_gradient(kw: dict) -> None:
    model = _graph(**kw)
    assert mark_causal_products(model) == 4
    assert _tri(model) == MARKED
    assert mark_causal_products(model) == 0  # marked once


@pytest.mark.parametrize(
    "mask", ["not_causal", "diagonal_masked", "padded", "additive_diagonal_masked"]
)
def test_pass_leaves_products_under_other_masks(mask: str) -> None:
    model = _graph(mask)
    assert mark_causal_products(model) == 0
    assert set(_tri(model).values()) == {0}


# --------------------------------------------------------------------------- training
GPT2 = Family(
    "GPT2LMHeadModel", "GPT2Config", "right",
    dict(n_embd=64, n_layer=2, n_head=4, n_positions=96, **NO_DROPOUT),
)  # fmt: skip


def _lm_batches(count: int, seq: int, padded: bool) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(count):
        ids = torch.randint(5, 101, (3, seq), generator=g)
        batch = {"input_ids": ids, "labels": ids.clone()}
        if padded:
            mask = torch.ones_like(ids)
            mask[1, -9:] = 0
            batch["attention_mask"] = mask
            batch["labels"] = ids.masked_fill(mask == 0, -100)
        out.append(batch)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padded"])
def test_gpt2_trains_like_eager_on_triangular_products(
    padded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    _batch_library()
    monkeypatch.setenv(COST_ENV, "batch_matmul_min_flops=0")  # the forked build inherits it
    trainer = _trains_like_eager(
        GPT2.build(), _lm_batches(3, 80, padded), options=TrainerOptions(cpu_gemm="blas")
    )
    stages = {(r.graph, r.stage) for r in trainer.build_log}
    assert {("train", "causal_products"), ("eval", "causal_products")} <= stages
    for graph in trainer.train_graphs:
        marked = [n for n in graph.graph if n.attributes.get_int("triA", 0)]
        # per layer: P @ V, P^T @ dO, dS @ K, dS^T @ Q; none under the And-ed padding mask
        assert len(marked) == (0 if padded else 4 * 2)
