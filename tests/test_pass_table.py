"""The pass table (``docs/passes.md``) is generated from the pipeline and lists every pass.

1. ``docs/passes.md`` is what ``python -m ortrain.graph_passes.pass_table`` makes now.
2. Every module of a stage folder under ``graph_passes/`` implements a listed pass or is
   on ``HELPERS`` (rule tables, analyses, builders of other graphs); no helper entry is
   stale.
3. Every pass names a test file that exists, a known stage and target.
4. Every listed pass is reachable: some configuration's ``build_pipeline`` holds it; the
   evaluation pipeline is the training pipeline's order restricted to its ``on_eval``
   passes, with no autodiff and no pass that needs gradients.
"""

from __future__ import annotations

import pkgutil
from pathlib import Path

import pytest

import ortrain.graph_passes as graph_passes
from ortrain.core.build_config import BuildConfig, BuildInputs
from ortrain.graph_passes import pass_table
from ortrain.graph_passes.infra.pipeline import STAGES, TARGETS, Pass, SerializedPass
from ortrain.graph_passes.training_pipeline import (
    BuildProducts,
    build_pipeline,
    eval_pipeline,
    target_pipeline,
)

REPO = Path(__file__).resolve().parent.parent
STAGE_FOLDERS = (
    "prepare", "cleanup", "fusions", "autodiff", "precision", "training", "memory",
    "targets.cpu",
)  # fmt: skip
# Modules of the stage folders that hold no pass of the pipeline (prefix match on the
# dotted name under ortrain.graph_passes).
HELPERS = (
    "autodiff.context",  # the rules' emission context
    "cleanup.export_cleanup",  # run by the export (ortrain/export.py), before the pipeline
    "cleanup.keep_input_names",  # a step of export_cleanup's and forward_cleanup's passes
    "autodiff.registry",  # the rule table
    "autodiff.rules.",  # the gradient rules (autodiff's table entries)
    "fusions._common",  # pattern helpers shared by the fusions
    "memory.memory_plan",  # the memory plan and report: an analysis, no rewrite
    "training.optimizer.",  # the update graph (a graph of its own, not a pass over this one)
    "training.zero",  # ZeRO-1's shard update graphs (idem)
    "targets.cpu.cost_model",  # the CPU target's tuned thresholds, read by its lowerings
)


def _stage_modules() -> list[str]:
    found = []
    for info in pkgutil.walk_packages(graph_passes.__path__, "ortrain.graph_passes."):
        name = info.name.removeprefix("ortrain.graph_passes.")
        if info.ispkg or not name.startswith(tuple(f + "." for f in STAGE_FOLDERS)):
            continue
        found.append(name)
    return found


def test_doc_is_generated_from_the_pipeline():
    doc = REPO / "docs" / "passes.md"
    assert doc.is_file(), "run: python -m ortrain.graph_passes.pass_table --write"
    assert doc.read_text() == pass_table.render(), (
        "docs/passes.md is stale: python -m ortrain.graph_passes.pass_table --write"
    )


def test_every_stage_module_is_listed_or_a_helper():
    listed = {p.module.removeprefix("ortrain.graph_passes.") for p in pass_table.all_passes()}
    modules = _stage_modules()
    assert len(modules) > 30  # the walk found the stage folders
    missing = [m for m in modules if m not in listed and not m.startswith(HELPERS)]
    assert not missing, f"modules of stage folders whose passes the table does not list: {missing}"
    stale = [h for h in HELPERS if not any(m.startswith(h) for m in modules)]
    assert not stale, f"helpers that no longer exist: {stale}"
    both = [m for m in modules if m in listed and m.startswith(HELPERS)]
    assert not both, f"listed passes kept on the helper list: {both}"


def test_every_pass_names_an_existing_test_stage_and_target():
    passes = pass_table.all_passes()
    assert len({p.name for p in passes}) == len(passes), "pass names repeat"
    for p in passes:
        assert p.stage in STAGES and p.target in TARGETS, p
        assert p.test.startswith("tests/test_") and (REPO / p.test).is_file(), (p.name, p.test)
        assert p.gate, p.name
    # the serialized passes come last: the runner serializes once, before the first of them
    kinds = [isinstance(p, SerializedPass) for p in passes]
    assert kinds == sorted(kinds) and any(kinds)


def test_every_pass_is_reachable_and_eval_is_the_forward_prefix():
    inputs = pass_table.EVERY_INPUT
    names = [p.name for p in pass_table.all_passes()]
    reached: set[str] = set()
    for config in pass_table.every_gate_configs():
        built = [p.name for p in build_pipeline(config, inputs, BuildProducts())]
        assert built == [n for n in names if n in built]  # the table's order
        reached |= set(built)
    assert reached == set(names)

    evaluated = [p.name for p in eval_pipeline(pass_table.EVERY_GATE)]
    on_eval = [p.name for p in pass_table.all_passes() if p.on_eval]
    assert evaluated == on_eval
    forward = names[: names.index("autodiff")]
    assert [n for n in evaluated if n in forward] == evaluated[: len(set(evaluated) & set(forward))]
    for needs_gradients in ("autodiff", "loss_scaling", "accumulate", "scatter_in_place"):
        assert needs_gradients not in evaluated


def test_cpu_lowerings_stay_off_other_targets():
    config = BuildConfig(target="cuda", mixed_precision="fp16", loss_scaling=True)
    built = build_pipeline(config, BuildInputs("loss"), BuildProducts())
    assert built and all(p.target == "any" for p in built)
    assert [p.name for p in built if isinstance(p, SerializedPass)] == ["ort_order"]
    # autodiff would still emit ortrain.cpu kernels for cpu_kernels: refused outright
    for option in ("cpu_kernels", "blas_gemm", "blas_batch"):
        with pytest.raises(ValueError, match=f"target 'cuda': {option} lower to ortrain's CPU"):
            BuildConfig(target="cuda", **{option: True})


def test_the_target_stage_alone_is_the_pipelines_target_passes():
    """``target_pipeline`` (what ``TrainingSession.load`` lowers offline artifacts with) is
    the full pipeline's target stage, same order and gates, for every gate combination."""
    inputs = pass_table.EVERY_INPUT
    for config in pass_table.every_gate_configs():
        full = build_pipeline(config, inputs, BuildProducts())
        expected = [p.name for p in full if isinstance(p, Pass) and p.stage == "target"]
        assert [p.name for p in target_pipeline(config, inputs, BuildProducts())] == expected
    kernels = BuildConfig(blas_gemm=True, blas_batch=True, cpu_kernels=True)
    names = [p.name for p in target_pipeline(kernels, inputs, BuildProducts())]
    assert names == [
        "half_in_float", "blas_gemm", "blas_batch_matmul", "scatter_rows", "scatter_in_place",
        "cpu_softmax",
        "cpu_scatter_last", "causal_products", "gelu_value", "cpu_layer_norm", "cpu_gelu",
        "cpu_dropout", "layer_norm_grad_sum", "cpu_split_concat", "cpu_elementwise",
        "transposed_activations",
    ]  # fmt: skip
    # on CPU builds without ortrain's kernels: the 16-bit nodes ONNX Runtime lacks, only
    assert [p.name for p in target_pipeline(BuildConfig(), inputs, BuildProducts())] == [
        "half_in_float"
    ]


_FORWARD = [
    "seed_dropout", "masked_attention_rows", "stable_log_sigmoid", "exact_sigmoid_under_log",
    "clean_forward",
    "pad_as_concat", "fuse_gelu", "fuse_layer_norm", "fuse_rms_norm", "fuse_matmul_transpose",
    "fuse_matmul_add", "fuse_bias_gelu", "pow_as_mul",
]  # fmt: skip


@pytest.mark.parametrize(
    "config, expected",
    [
        (
            BuildConfig(blas_gemm=True, blas_batch=True, cpu_kernels=True),
            [*_FORWARD, "drop_stop_gradients", "lower_cross_entropy", "half_in_float",
             "blas_gemm", "blas_batch_matmul", "cpu_softmax", "causal_products", "cpu_layer_norm",
             "cpu_gelu", "cpu_split_concat", "cpu_elementwise", "ort_order", "kernel_threads"],
        ),
        (
            BuildConfig(target="cuda", mixed_precision="fp16"),
            [*_FORWARD, "mixed_precision", "drop_stop_gradients", "lower_cross_entropy",
             "ort_order"],
        ),
        (
            BuildConfig(optimize=False),
            ["seed_dropout", "masked_attention_rows", "stable_log_sigmoid",
             "exact_sigmoid_under_log", "drop_stop_gradients", "half_in_float", "ort_order",
             "kernel_threads"],
        ),
    ],
    ids=["cpu-kernels", "cuda-fp16", "no-optimize"],
)  # fmt: skip
def test_eval_pipelines_are_pinned(config: BuildConfig, expected: list[str]) -> None:
    """The evaluation pipeline written out (as the eval list was before the ``on_eval``
    flags): flipping a pass's flag changes evaluation graphs, and must change this."""
    assert [p.name for p in eval_pipeline(config)] == expected


def test_a_pass_that_returns_none_is_rejected():
    """``modified`` comes from the pass: a function returning nothing breaks the contract."""
    import onnx_ir as ir

    p = Pass("returns_nothing", lambda m: None, stage="cleanup", test="tests/test_pass_table.py")
    model = ir.Model(ir.Graph([], [], nodes=[], opset_imports={"": 18}), ir_version=10)
    with pytest.raises(TypeError, match="returns_nothing"):
        p(model)
    counted = Pass("counted", lambda m: 0, stage="cleanup", test="tests/test_pass_table.py")
    assert counted(model).modified is False
