"""graph_passes/targets/cpu/cost_model.py: the CPU target's one cost model.

- the facts read on this machine are sane, and the reader parses sysfs / cpuinfo as
  written there (a made-up machine), with defaults where the system says nothing;
- thresholds come only from the model: no tuned constant left in the lowerings' modules,
  every thresholded lowering takes a ``cost``; ``ORTRAIN_CPU_COST`` overrides by name and
  rejects what it cannot take;
- a lowering given a model whose threshold is moved changes its decision (here and in each
  lowering's own tests), and every lowering returns the count of nodes it rewrote.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from ortrain.core.names import BLAS_DOMAIN, CPU_DOMAIN
from ortrain.graph_passes.targets.cpu import cost_model
from ortrain.graph_passes.targets.cpu.blas_batch_matmul import lower_batch_matmul
from ortrain.graph_passes.targets.cpu.blas_gemm import lower_gemm_to_blas
from ortrain.graph_passes.targets.cpu.causal_products import mark_causal_products
from ortrain.graph_passes.targets.cpu.cost_model import COST_ENV, CpuCostModel, CpuFacts
from ortrain.graph_passes.targets.cpu.elementwise import lower_elementwise
from ortrain.graph_passes.targets.cpu.gelu import lower_gelu
from ortrain.graph_passes.targets.cpu.gelu_value import take_gelu_values
from ortrain.graph_passes.targets.cpu.layer_norm import lower_layer_norm
from ortrain.graph_passes.targets.cpu.layer_norm_grad_sum import fold_layer_norm_grad_sums
from ortrain.graph_passes.targets.cpu.scatter_in_place import base_ready_leaves
from ortrain.graph_passes.targets.cpu.scatter_last import lower_scatter_last
from ortrain.graph_passes.targets.cpu.scatter_rows import lower_scatter_add_rows
from ortrain.graph_passes.targets.cpu.softmax import lower_softmax
from ortrain.graph_passes.targets.cpu.split_concat import lower_split_concat
from ortrain.graph_passes.targets.cpu.transposed_activations import write_activations_transposed
from ortrain.graph_passes.targets.cpu.transposed_weight_grad import transpose_weight_gradients

pytestmark = pytest.mark.unit
CPU_DIR = Path(cost_model.__file__).parent
F32 = TensorProto.FLOAT


def cost(**thresholds: float) -> CpuCostModel:
    """This machine's model with ``thresholds`` moved (for the lowerings' tests)."""
    return dataclasses.replace(CpuCostModel.for_machine(), **thresholds)


# ------------------------------------------------------------------------------ facts
def test_this_machines_facts_are_sane() -> None:
    facts = CpuFacts.read()
    assert facts.isa in ("avx512", "avx2", "avx", "sse")
    assert facts.vector_bytes == {"avx512": 64, "avx2": 32, "avx": 32, "sse": 16}[facts.isa]
    assert 8 * 1024 <= facts.l1d_bytes <= 1024 * 1024 and facts.l1d_bytes % 1024 == 0
    assert 1 <= facts.l1d_ways <= 64
    assert facts.l2_bytes >= facts.l1d_bytes
    assert facts.cores == len(os.sched_getaffinity(0))
    stride = CpuCostModel.for_machine().aliasing_stride
    assert stride == facts.l1d_bytes // facts.l1d_ways and stride & (stride - 1) == 0


def _fake_machine(root: Path, caches: list[tuple[int, str, str, str]], flags: str) -> None:
    for i, (level, kind, size, ways) in enumerate(caches):
        entry = root / "cache" / f"index{i}"
        entry.mkdir(parents=True)
        for name, text in (("level", level), ("type", kind), ("size", size)):
            (entry / name).write_text(f"{text}\n")
        (entry / "ways_of_associativity").write_text(f"{ways}\n")
    (root / "cpuinfo").write_text(f"processor\t: 0\nflags\t\t: {flags}\n\n")


def _read_fresh(root: Path, monkeypatch: pytest.MonkeyPatch) -> CpuFacts:
    monkeypatch.setattr(cost_model, "_CACHE", root / "cache")
    monkeypatch.setattr(cost_model, "_CPUINFO", root / "cpuinfo")
    return CpuFacts.read.__wrapped__()  # not the cached facts of this machine


def test_facts_are_read_as_the_system_writes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    caches = [(1, "Instruction", "32K", "8"), (1, "Data", "64K", "16"),
              (2, "Unified", "2048K", "16"), (3, "Unified", "32M", "16")]  # fmt: skip
    _fake_machine(tmp_path, caches, "fpu sse2 avx fma avx2")
    facts = _read_fresh(tmp_path, monkeypatch)
    assert (facts.isa, facts.vector_bytes) == ("avx2", 32)
    assert (facts.l1d_bytes, facts.l1d_ways, facts.l2_bytes) == (64 * 1024, 16, 2 * 1024 * 1024)
    assert CpuCostModel.for_machine(facts).aliasing_stride == 4096


def test_facts_default_where_the_system_says_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    facts = _read_fresh(tmp_path / "nowhere", monkeypatch)
    default = CpuFacts()
    assert dataclasses.replace(facts, cores=default.cores) == default
    # an associativity sysfs leaves at 0 (fully associative / unknown) keeps the default
    _fake_machine(tmp_path, [(1, "Data", "48K", "0")], "sse2")
    facts = _read_fresh(tmp_path, monkeypatch)
    assert (facts.isa, facts.l1d_bytes, facts.l1d_ways) == ("sse", 48 * 1024, default.l1d_ways)


# ------------------------------------------------------------------ thresholds: the model only
_ABI = {"MAX_SUM", "MAX_RANK", "MAX_PARTS", "MAX_AFTER"}  # what the C kernels accept
# float32's size; a search's budget; tables of axes and input / output positions
_NOT_TUNING = {"_F32_BYTES", "_FOLLOW", "_SWAP", "_CARRY", "_TRANSPOSABLE"}


def test_no_tuned_constant_is_left_in_the_lowerings() -> None:
    """A module-level number in targets/cpu/ outside the cost model is a kernel ABI limit
    or a fact, listed here by name; a new threshold belongs in ``CpuCostModel``."""
    found = []
    for path in sorted(CPU_DIR.glob("*.py")):
        if path.name == "cost_model.py":
            continue
        found += [(path.name, name) for name in _numeric_assignments(path.read_text())]
    assert found and {name for _, name in found} <= _ABI | _NOT_TUNING, found


def _numeric_assignments(source: str) -> list[str]:
    """Names a module assigns an expression holding a number to (``X = 4096``, ``X: int =
    4 * 1024``, ``X = 1 << 20``, ``X = {"a": 2}``), at module level."""
    names = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        numbers = [
            c.value
            for c in ast.walk(value)
            if isinstance(c, ast.Constant) and type(c.value) in (int, float)
        ]
        if numbers:
            names += [t.id for t in targets if isinstance(t, ast.Name)]
    return names


def test_the_constant_scan_sees_every_form() -> None:
    source = (
        "A = 4096\nB: int = 4 * 1024\nC = 1 << 20\nD = {'x': 2.5}\nE = 'text'\nF = True\nG: str\n"
    )
    assert _numeric_assignments(source) == ["A", "B", "C", "D"]


@pytest.mark.parametrize(
    "lowering",
    [lower_gemm_to_blas, lower_batch_matmul, lower_elementwise, lower_softmax,
     transpose_weight_gradients, write_activations_transposed],
    ids=lambda f: f.__name__,
)  # fmt: skip
def test_thresholded_lowerings_take_the_model(lowering) -> None:
    params = list(inspect.signature(lowering).parameters.values())
    assert [p.name for p in params] == ["model", "cost"]
    assert params[1].default is None


def test_overrides_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    default = CpuCostModel.for_machine()
    monkeypatch.setenv(COST_ENV, " gemm_min_flops=0, elementwise_min_elements=1e3 ")
    moved = CpuCostModel.for_machine()
    assert moved.gemm_min_flops == 0.0 and moved.elementwise_min_elements == 1000
    assert isinstance(moved.elementwise_min_elements, int)
    back = {"gemm_min_flops": default.gemm_min_flops,
            "elementwise_min_elements": default.elementwise_min_elements}  # fmt: skip
    assert dataclasses.replace(moved, **back) == default  # nothing else moved


@pytest.mark.parametrize(
    "spec,match",
    [("gemm_flops=0", "unknown threshold 'gemm_flops'"), ("facts=1", "unknown threshold"),
     ("gemm_min_flops=lots", "is not a number"), ("softmax_loss_min_row=1.5", "whole number"),
     ("transposed_grad_min_rows=-1", "negative")],
)  # fmt: skip
def test_bad_overrides_are_named(spec: str, match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(COST_ENV, spec)
    with pytest.raises(ValueError, match=match):
        CpuCostModel.for_machine()


# ------------------------------------------------------------------------ decisions move
def _model(nodes: list, inputs: dict[str, list[int]], outputs: list[str]) -> ir.Model:
    vis = [helper.make_tensor_value_info(n, F32, s) for n, s in inputs.items()]
    outs = [helper.make_tensor_value_info(n, F32, None) for n in outputs]
    proto = helper.make_model(
        helper.make_graph(nodes, "g", vis, outs), opset_imports=[helper.make_opsetid("", 18)]
    )
    return ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(proto))


def _mul_model() -> ir.Model:  # 32 x 32 = 1024 elements
    return _model([helper.make_node("Mul", ["a", "b"], ["y"])], {"a": [32, 32], "b": [32]}, ["y"])


def test_a_moved_threshold_moves_the_decision() -> None:
    assert lower_elementwise(_mul_model()) == 0  # far below the default
    assert lower_elementwise(_mul_model(), cost(elementwise_min_elements=1024)) == 1
    assert lower_elementwise(_mul_model(), cost(elementwise_min_elements=1025)) == 0


def test_a_lowering_given_no_model_reads_the_environments(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a forked build sees: the lowering builds the model from the environment."""
    monkeypatch.setenv(COST_ENV, "elementwise_min_elements=1024,gemm_min_flops=65536")
    model = _mul_model()
    assert lower_elementwise(model) == 1 and model.graph.node(0).domain == CPU_DOMAIN
    gemm = _model([helper.make_node("MatMul", ["a", "w"], ["y"])], {"a": [32, 32], "w": [32, 32]},
                  ["y"])  # fmt: skip
    assert lower_gemm_to_blas(gemm) == 1 and gemm.graph.node(0).domain == BLAS_DOMAIN


@pytest.mark.parametrize(
    "lowering",
    [lower_gemm_to_blas, lower_batch_matmul, lower_elementwise, lower_softmax, lower_gelu,
     lower_layer_norm, lower_scatter_last, lower_scatter_add_rows, lower_split_concat,
     mark_causal_products, take_gelu_values, fold_layer_norm_grad_sums,
     transpose_weight_gradients, write_activations_transposed,
     lambda m: base_ready_leaves(m, [])],
    ids=lambda f: f.__name__,
)  # fmt: skip
def test_every_lowering_returns_a_count(lowering) -> None:
    """The pipeline's pass contract reads ``modified`` from it: 0 on a graph it leaves."""
    model = _model([helper.make_node("Relu", ["a"], ["y"])], {"a": [2, 3]}, ["y"])
    result = lowering(model)
    assert type(result) is int and result == 0


def test_the_cache_key_holds_what_the_lowerings_read() -> None:
    """Another core count or ISA builds the same graphs (same key); another L1 geometry or
    threshold does not. Configurations without CPU lowerings carry no cost model at all."""
    from ortrain.build_cache import _settings_token
    from ortrain.core.build_config import BuildConfig

    base = CpuCostModel.for_machine(CpuFacts(l1d_bytes=32 * 1024, l1d_ways=8, cores=2))
    other_cores = CpuCostModel.for_machine(
        CpuFacts(l1d_bytes=32 * 1024, l1d_ways=8, cores=64, isa="avx512", vector_bytes=64)
    )
    assert base.key() == other_cores.key()
    other_l1 = CpuCostModel.for_machine(CpuFacts(l1d_bytes=48 * 1024, l1d_ways=12))
    assert other_l1.aliasing_stride == base.aliasing_stride  # 4 KiB ways both
    bigger_ways = CpuCostModel.for_machine(CpuFacts(l1d_bytes=64 * 1024, l1d_ways=8))
    assert bigger_ways.key() != base.key()
    assert dataclasses.replace(base, softmax_loss_min_row=1).key() != base.key()
    plain = BuildConfig()
    assert _settings_token(plain) == repr(plain)
    kernels = BuildConfig(cpu_kernels=True)
    assert _settings_token(kernels) == f"{kernels!r} {CpuCostModel.for_machine().key()}"
