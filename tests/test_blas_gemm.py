"""The BLAS GEMM custom op (``ortrain/runtime/blas_gemm.c``) and the pass that uses it.

- the pass on hand-built graphs: which products move (and with which attributes), which
  stay, the size threshold;
- the op against numpy in float64 over a table of layouts (transposes, alpha / beta,
  every C form, batched A, empty products), and its error on mismatched shapes;
- training through it (every eligible product moved) against eager on model families and
  configs beyond GPT-2 / BERT: first-step gradients element-wise, losses, eval logits;
- ``TrainerOptions.cpu_gemm``: the choices and a clear error when the op cannot be built.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ortrain import TrainerOptions
from ortrain.graph_passes.targets.cpu.blas_gemm import BLAS_DOMAIN, lower_gemm_to_blas
from ortrain.graph_passes.targets.cpu.cost_model import COST_ENV, CpuCostModel
from ortrain.runtime import cpu_ops
from tests.test_cpu_cost_model import cost
from tests.test_model_families import FAMILIES, NO_DROPOUT, Family, _batch, _trains_like_eager

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def _library() -> str:
    """The built op. Skips only where a prerequisite is missing (no C compiler, no sgemm in
    torch's library); a compile or load failure of the op itself fails the test."""
    try:
        cpu_ops._compiler()
        cpu_ops._torch_sgemm()
    except cpu_ops.CpuOpsLibraryError as exc:
        pytest.skip(f"the BLAS GEMM op cannot be built here: {exc}")
    return str(cpu_ops.blas_library_path())


# --------------------------------------------------------------------------- the pass
def _graph(nodes: list[onnx.NodeProto], inputs: dict[str, tuple[int, list]]) -> ir.Model:
    vis = [helper.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()]
    outs = [helper.make_empty_tensor_value_info(n.output[0]) for n in nodes]
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    proto = helper.make_model(helper.make_graph(nodes, "g", vis, outs), opset_imports=opsets)
    proto = onnx.shape_inference.infer_shapes(proto)
    return ir.serde.deserialize_model(proto)


def _node(model: ir.Model, output: str) -> ir.Node:
    return next(n for n in model.graph if n.outputs[0].name == output)


def test_pass_moves_eligible_products_and_keeps_the_rest() -> None:
    mk = helper.make_node
    nodes = [
        mk("MatMul", ["x3", "w"], ["linear"]),  # [2, 3, 8] x [8, 4]: yes
        mk("MatMul", ["x3", "wb"], ["batched"]),  # right operand batched: no
        mk("Gemm", ["x2", "w", "bias"], ["gemm"], beta=0.5, alpha=2.0),  # C a row: yes
        mk("Gemm", ["x2", "w", "col"], ["gemm_col"]),  # C [M, 1]: no
        mk("Gemm", ["w", "x2t", "full"], ["gemm_t"], transA=1, transB=1),  # C [M, N]: yes
        mk("FusedMatMul", ["xt", "w"], ["fused"], domain="com.microsoft", transA=1, alpha=0.25),
        mk("FusedMatMul", ["x3", "w"], ["fused_batch"], domain="com.microsoft", transBatchA=1),
        mk("MatMul", ["h3", "wh"], ["half"]),  # fp16: no
        mk("MatMul", ["xd", "w"], ["dynamic"]),  # a symbolic dimension: no
    ]
    model = _graph(
        nodes,
        {
            "x3": (F32, [2, 3, 8]),
            "w": (F32, [8, 4]),
            "wb": (F32, [2, 8, 4]),
            "x2": (F32, [3, 8]),
            "x2t": (F32, [3, 8]),
            "bias": (F32, [4]),
            "col": (F32, [3, 1]),
            "full": (F32, [4, 3]),
            "xt": (F32, [8, 5]),
            "h3": (F16, [2, 3, 8]),
            "wh": (F16, [8, 4]),
            "xd": (F32, ["batch", 8]),
        },
    )
    assert lower_gemm_to_blas(model, cost(gemm_min_flops=0)) == 4
    moved = {n.outputs[0].name for n in model.graph if n.domain == BLAS_DOMAIN}
    assert moved == {"linear", "gemm", "gemm_t", "fused"}
    assert all(n.op_type == "Gemm" for n in model.graph if n.domain == BLAS_DOMAIN)
    assert model.opset_imports[BLAS_DOMAIN] == 1
    attrs = {k: v.value for k, v in _node(model, "gemm").attributes.items()}
    assert attrs == {"transA": 0, "transB": 0, "alpha": 2.0, "beta": 0.5}
    attrs = {k: v.value for k, v in _node(model, "fused").attributes.items()}
    assert attrs == {"transA": 1, "transB": 0, "alpha": 0.25}
    assert dict(_node(model, "linear").attributes) == {}
    kept = {n.outputs[0].name: n.op_type for n in model.graph if n.domain != BLAS_DOMAIN}
    assert kept == {
        "batched": "MatMul",
        "gemm_col": "Gemm",
        "fused_batch": "FusedMatMul",
        "half": "MatMul",
        "dynamic": "MatMul",
    }


def test_pass_threshold_counts_flops() -> None:
    """2 M N K: [2, 3, 8] x [8, 4] is 384 FLOPs; the default threshold keeps it."""
    inputs = {"x": (F32, [2, 3, 8]), "w": (F32, [8, 4])}
    model = _graph([helper.make_node("MatMul", ["x", "w"], ["y"])], inputs)
    assert lower_gemm_to_blas(model) == 0 and CpuCostModel.for_machine().gemm_min_flops > 384
    assert BLAS_DOMAIN not in model.opset_imports
    assert lower_gemm_to_blas(model, cost(gemm_min_flops=385)) == 0
    assert lower_gemm_to_blas(model, cost(gemm_min_flops=384)) == 1


# --------------------------------------------------------------------------- the op
def _session(node: onnx.NodeProto, inputs: dict[str, list[int]]) -> ort.InferenceSession:
    vis = [helper.make_tensor_value_info(n, F32, s) for n, s in inputs.items()]
    out = [helper.make_tensor_value_info("Y", F32, None)]
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(BLAS_DOMAIN, 1)]
    proto = helper.make_model(helper.make_graph([node], "g", vis, out), opset_imports=opsets)
    so = ort.SessionOptions()
    so.register_custom_ops_library(_library())
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


# (A shape, B shape, C shape or None, attributes)
CASES = [
    ([5, 7], [7, 3], None, {}),
    ([7, 5], [7, 3], None, {"transA": 1}),
    ([5, 7], [3, 7], None, {"transB": 1}),
    ([7, 5], [3, 7], None, {"transA": 1, "transB": 1, "alpha": 0.5}),
    ([2, 3, 9], [9, 4], None, {}),  # leading dims of A are rows
    ([4, 2, 3, 9], [4, 9], None, {"transB": 1, "alpha": -1.5}),
    ([9], [9, 4], None, {}),  # a vector times a matrix
    ([64, 300], [300, 129], [129], {"beta": 0.5}),  # C a row
    ([300, 64], [129, 300], [1, 129], {"transA": 1, "transB": 1}),
    ([64, 300], [300, 129], [64, 129], {"alpha": 2.0, "beta": -1.0}),  # C full
    ([64, 300], [300, 129], [1], {"beta": 3.0}),  # C a scalar
    ([64, 300], [300, 129], [64, 129], {"beta": 0.0}),  # beta 0: C ignored
    ([0, 7], [7, 3], None, {}),  # no rows
    ([5, 0], [0, 3], None, {}),  # K = 0: zeros
    ([5, 0], [0, 3], [3], {"beta": 2.0}),  # K = 0: beta * C
]


@pytest.mark.parametrize(("a_shape", "b_shape", "c_shape", "attrs"), CASES)
def test_op_matches_numpy(
    a_shape: list[int], b_shape: list[int], c_shape: list[int] | None, attrs: dict
) -> None:
    rng = np.random.default_rng(0)
    feeds = {"A": rng.standard_normal(a_shape), "B": rng.standard_normal(b_shape)}
    if c_shape is not None:
        feeds["C"] = rng.standard_normal(c_shape)
    feeds = {k: v.astype(np.float32) for k, v in feeds.items()}
    node = helper.make_node("Gemm", list(feeds), ["Y"], domain=BLAS_DOMAIN, **attrs)
    got = _session(node, {k: list(v.shape) for k, v in feeds.items()}).run(None, feeds)[0]
    a, b = (feeds[k].astype(np.float64) for k in "AB")
    a = a.T if attrs.get("transA") else a
    b = b.T if attrs.get("transB") else b
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    want, scale = alpha * (a @ b), abs(alpha) * (np.abs(a) @ np.abs(b))
    if c_shape is not None:
        want = want + beta * feeds["C"].astype(np.float64)
        scale = scale + abs(beta) * np.abs(feeds["C"].astype(np.float64))
    assert got.dtype == np.float32 and got.shape == want.shape
    # float32 rounding of a K-term sum: ~sqrt(K) unit roundoffs of the terms' magnitude
    tol = 4 * np.sqrt(a.shape[-1] + 2) * np.finfo(np.float32).eps / 2 * scale
    assert np.all(np.abs(got - want) <= tol), np.max(np.abs(got - want) - tol)


def test_op_names_mismatched_shapes() -> None:
    node = helper.make_node("Gemm", ["A", "B"], ["Y"], domain=BLAS_DOMAIN)
    sess = _session(node, {"A": [5, 7], "B": [6, 3]})
    feeds = {"A": np.zeros((5, 7), np.float32), "B": np.zeros((6, 3), np.float32)}
    with pytest.raises(Exception, match=r"ortrain.blas.Gemm: inner dimensions differ: "
                       r"op\(A\) is \[5, 7\], op\(B\) is \[6, 3\]"):  # fmt: skip
        sess.run(None, feeds)


# --------------------------------------------------------------------------- training
MODELS = {
    "gpt2": Family(
        "GPT2LMHeadModel", "GPT2Config", "right",
        dict(n_embd=64, n_layer=2, n_head=4, n_positions=24, **NO_DROPOUT),
    ),
    "roberta": FAMILIES["roberta"],  # MLM: the label-sparse head
    "llama": FAMILIES["llama"],  # bias-free Linear layers: MatMul
    "bart": FAMILIES["bart"],  # encoder-decoder
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_trains_like_eager_on_the_blas_op(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every eligible product of the gradient and eval graphs on the op (threshold 0)."""
    _library()
    monkeypatch.setenv(COST_ENV, "gemm_min_flops=0")  # the forked build inherits it
    family = MODELS[name]
    g = torch.Generator().manual_seed(1)
    batches = [_batch(family.batch, g) for _ in range(3)]
    trainer = _trains_like_eager(family.build(), batches, options=TrainerOptions(cpu_gemm="blas"))
    moved = [r for r in trainer.build_log if r.stage == "blas_gemm"]
    assert {r.graph for r in moved} == {"train", "eval"}
    for r in moved:
        assert r.op_delta.get(f"{BLAS_DOMAIN}::Gemm", 0) >= 8, r.op_delta


def test_onnxruntime_choice_leaves_the_graph_alone() -> None:
    family = MODELS["gpt2"]
    batches = [_batch(family.batch, torch.Generator().manual_seed(1))]
    options = TrainerOptions(cpu_gemm="onnxruntime")
    trainer = _trains_like_eager(family.build(), batches, options=options)
    assert not [r for r in trainer.build_log if r.stage == "blas_gemm"]


# --------------------------------------------------------------------------- the option
def test_cpu_gemm_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="cpu_gemm must be 'auto', 'blas' or 'onnxruntime'"):
        TrainerOptions(cpu_gemm="mkl")
    assert not cpu_ops.use_blas_gemm("onnxruntime")
    assert not cpu_ops.use_blas_gemm("blas", device_type="cuda")
    monkeypatch.setattr(cpu_ops, "_intel_cpu", lambda: False)
    assert not cpu_ops.use_blas_gemm("auto")  # MLAS is the faster one on AMD


def test_unbuildable_op_fails_clearly(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("ORTRAIN_CACHE_DIR", str(tmp_path))
    # no installed library (an empty ORTRAIN_NATIVE_DIR): the development build runs
    monkeypatch.setenv("ORTRAIN_NATIVE_DIR", str(tmp_path / "no-native"))
    cpu_ops.cache_clear()
    try:
        monkeypatch.setenv("CC", "false")  # a "compiler" that fails
        with pytest.raises(cpu_ops.CpuOpsLibraryError, match=r"cpu_gemm='blas': `false .*` failed"):
            cpu_ops.use_blas_gemm("blas")
        assert not list(tmp_path.glob("*.so"))  # nothing half-written left behind
        monkeypatch.delenv("CC")
        not_a_folder = tmp_path / "file"
        not_a_folder.write_text("")
        monkeypatch.setenv("ORTRAIN_CACHE_DIR", str(not_a_folder))
        with pytest.raises(cpu_ops.CpuOpsLibraryError, match="cpu_gemm='blas': cannot build"):
            cpu_ops.use_blas_gemm("blas")
        monkeypatch.setattr(cpu_ops.shutil, "which", lambda name: None)
        with pytest.raises(cpu_ops.CpuOpsLibraryError, match="cpu_gemm='blas': no C compiler"):
            cpu_ops.use_blas_gemm("blas")
        monkeypatch.setattr(cpu_ops, "_intel_cpu", lambda: True)
        monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: True)
        with pytest.warns(RuntimeWarning, match="products run on ONNX Runtime's MLAS"):
            assert not cpu_ops.use_blas_gemm("auto")
    finally:
        cpu_ops.cache_clear()
