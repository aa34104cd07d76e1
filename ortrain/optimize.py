"""`ortrain optimize`: forward graph passes for any ONNX model, checked by ONNX Runtime.

Levels:
- basic: dropout seeding (so CSE cannot merge two independent Dropouts on one input),
  constant folding (onnxscript optimizer, named size limits), CSE, dead-code removal,
  GELU fusion, lowering of 2-D SoftmaxCrossEntropyLoss.
- extended: basic + onnxscript's ORT fusions: Transpose into FusedMatMul, Add+Gelu into
  BiasGelu, RMSNorm chains (Llama, T5...) into SimplifiedLayerNormalization, residual Add +
  LayerNormalization / RMSNorm into SkipLayerNormalization /
  SkipSimplifiedLayerNormalization.
Both end with ``Pow(x, 2 or 3)`` written as products (ONNX Runtime's CPU Pow is slow).

After the pipeline the optimized and the original model run on the same random inputs;
a mismatch re-runs the passes one by one to name the pass to blame. Symbolic dimensions
(dynamic batch and sequence axes) stay symbolic in the output; the check runs them at
``DEFAULT_DIM`` or at the sizes given by name (``--dim seq=128``).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common
import onnxruntime as ort
from onnxscript.rewriter import pattern
from onnxscript.rewriter._basics import MatchingTracer, MatchStatus
from onnxscript.rewriter.ort_fusions import bias_gelu, fused_matmul_rule_sets, rms_normalization

from ortrain.core.errors import OrtrainError, first_line
from ortrain.graph_passes.cleanup.forward_cleanup import clean_forward
from ortrain.graph_passes.cleanup.pow_as_mul import pow_as_mul
from ortrain.graph_passes.fusions import gelu, layer_norm
from ortrain.graph_passes.fusions.lower_cross_entropy import lower_softmax_cross_entropy
from ortrain.graph_passes.fusions.skip_layer_norm import SKIP_LAYER_NORM_RULES, SKIP_RMS_NORM_RULES
from ortrain.graph_passes.infra.pipeline import (
    Pass,
    PassRecord,
    Stage,
    format_table,
    run_pipeline,
)
from ortrain.graph_passes.infra.rule_index import by_root
from ortrain.graph_passes.prepare.dropout_seed import seed_dropouts

MS_DOMAIN = "com.microsoft"


class OptimizeError(OrtrainError):
    """An input that cannot be optimized, or a pass that changed the outputs."""


class FusionPass:
    """One fusion family's rule sets applied with onnxscript's matching tracer, so that a
    fusion that found nothing says why: no partial match (the pattern is absent), or the
    closest match and the check that rejected it."""

    def __init__(self, rule_sets: Callable[[ir.Model], Sequence[pattern.RewriteRuleSet]]):
        self.rule_sets = rule_sets
        self.why_not: str | None = None

    def __call__(self, model: ir.Model) -> int:
        rule_sets = self.rule_sets(model)
        count = sum(by_root(rules).apply_to_model(model) for rules in rule_sets)
        if any(n.domain == MS_DOMAIN for n in model.graph):
            model.opset_imports.setdefault(MS_DOMAIN, 1)
        self.why_not = None
        if not count:  # a traced run changes nothing: it only records the closest matches
            tracer = MatchingTracer()
            for rules in rule_sets:
                rules.apply_to_model(model, tracer=tracer)
            self.why_not = why_not(tracer, model)
        return count


def why_not(tracer: MatchingTracer, model: ir.Model) -> str:
    best = None
    for rule, matches in tracer.best_matches_map.items():
        for info in matches:
            if best is None or info.score() > best[1].score():
                best = (rule, info)
    if best is None:
        opset = model.opset_imports.get("", 0)
        return f"pattern absent (opset {opset}: no node starts a match)"
    rule, info = best
    reason = info.match_result.reason or "no reason given"
    where = f"node '{info.root_node.name}' ({info.root_node.op_type})"
    if info.status is MatchStatus.CONDITION_FAILED:
        return f"match rejected by {rule.name} at {where}: {reason}"
    if info.status is MatchStatus.REPLACEMENT_FAILED:
        return f"replacement failed for {rule.name} at {where}: {reason}"
    return f"pattern absent (closest: {rule.name} at {where}: {reason})"


def _one(rules: pattern.RewriteRuleSet) -> Callable[[ir.Model], list[pattern.RewriteRuleSet]]:
    return lambda _model: [rules]


TEST = "tests/test_optimize_cli.py"


def _pass(name: str, run: Callable[[ir.Model], object], stage: Stage, gate: str) -> Pass:
    return Pass(name, run, stage=stage, gate=gate, test=TEST, on_eval=True)


def passes(level: str) -> list[Pass]:
    """This tool's own list: it optimizes inference graphs (any ONNX model, no gradients,
    no trainer options), so it keeps its passes apart from the training pipeline
    (``graph_passes/training_pipeline.py``) while following the same ``Pass`` contract."""
    basic = [
        _pass("seed_dropouts", lambda m: seed_dropouts(m, 0), "prepare", "basic"),
        _pass("fold_constants", clean_forward, "cleanup", "basic"),
        _pass("cse", ir.passes.common.CommonSubexpressionEliminationPass(), "cleanup", "basic"),
        _pass("remove_unused", ir.passes.common.RemoveUnusedNodesPass(), "cleanup", "basic"),
        # shapes the exporter left out (TorchScript at opset 13-16): the fusions check them
        _pass(
            "infer_shapes", ir.passes.common.ShapeInferencePass(data_prop=True), "prepare", "basic"
        ),
        _pass("fuse_gelu", FusionPass(lambda m: [gelu.rules_for(m)]), "fusions", "basic"),
        _pass("fuse_layer_norm", FusionPass(layer_norm.rule_sets), "fusions", "basic"),
        _pass("lower_cross_entropy", lower_softmax_cross_entropy, "fusions", "basic"),
    ]
    if level == "basic":
        return [*basic, _pass("pow_as_mul", pow_as_mul, "cleanup", "basic")]
    if level != "extended":
        raise OptimizeError(f"unknown level {level!r}: use basic or extended")
    return [
        *basic,
        _pass(
            "fuse_matmul_transpose",
            FusionPass(lambda _m: [fused_matmul_rule_sets.fused_matmul_rule_sets()]),
            "fusions",
            "extended",
        ),
        _pass("fuse_bias_gelu", FusionPass(_one(bias_gelu.bias_gelu_rules)), "fusions", "extended"),
        _pass(
            "fuse_rms_norm",
            FusionPass(_one(rms_normalization.rms_normalization_ruleset)),
            "fusions",
            "extended",
        ),
        _pass("fuse_skip_rms_norm", FusionPass(_one(SKIP_RMS_NORM_RULES)), "fusions", "extended"),
        _pass(
            "fuse_skip_layer_norm", FusionPass(_one(SKIP_LAYER_NORM_RULES)), "fusions", "extended"
        ),
        # after the fusions whose patterns read Pow
        _pass("pow_as_mul", pow_as_mul, "cleanup", "extended"),
        _pass(
            "remove_unused_final", ir.passes.common.RemoveUnusedNodesPass(), "cleanup", "extended"
        ),
    ]


def load(path: str | Path) -> ir.Model:
    path = Path(path)
    if not path.is_file():
        raise OptimizeError(f"{path}: no such file")
    try:
        proto = onnx.load(str(path))
    except Exception as exc:
        raise OptimizeError(f"{path}: not a readable ONNX model ({type(exc).__name__})") from exc
    try:
        onnx.checker.check_model(proto)
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0]
        raise OptimizeError(f"{path}: invalid ONNX model: {first}") from exc
    return ir.serde.deserialize_model(proto)


_NP = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(bool)": np.bool_,
}


def _session(model: ir.Model) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    data = ir.serde.serialize_model(model).SerializeToString()
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


DEFAULT_DIM = 2  # size of a symbolic dimension in the check unless --dim names it


def symbolic_dims(sess: ort.InferenceSession) -> list[str]:
    """Names of the inputs' symbolic dimensions, in order of appearance."""
    names: list[str] = []
    for i in sess.get_inputs():
        names += [d for d in i.shape if isinstance(d, str) and d not in names]
    return names


def random_feeds(
    sess: ort.InferenceSession,
    seed: int = 0,
    int_high: int = 2,
    dims: Mapping[str, int] | None = None,
) -> dict:
    """Random inputs: N(0,1) floats; integers in [0, int_high) (valid indices/masks).

    A symbolic dimension takes its size from ``dims`` (by name), else ``DEFAULT_DIM``;
    inputs that share a name share the size.
    """
    dims = dict(dims or {})
    unknown = sorted(set(dims) - set(symbolic_dims(sess)))
    if unknown:
        raise OptimizeError(
            f"no input has a dimension named {', '.join(map(repr, unknown))}; the symbolic "
            f"dimensions are {symbolic_dims(sess) or 'none'}"
        )
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in sess.get_inputs():
        shape = [d if isinstance(d, int) else dims.get(d, DEFAULT_DIM) for d in i.shape]
        dtype = _NP.get(i.type)
        if dtype is None:
            raise OptimizeError(f"input '{i.name}' has unsupported type {i.type}")
        if np.issubdtype(dtype, np.floating):
            feeds[i.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype is np.bool_:
            feeds[i.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            feeds[i.name] = rng.integers(0, int_high, shape).astype(dtype)
    return feeds


def _outputs_match(a: ir.Model, b: ir.Model, feeds: dict, rtol: float, atol: float) -> str | None:
    ra = _session(a).run(None, feeds)
    try:
        rb = _session(b).run(None, feeds)
    except Exception as exc:  # a pass left a model ONNX Runtime rejects
        return f"ONNX Runtime cannot run the optimized model: {first_line(exc)}"
    names = [v.name for v in a.graph.outputs]
    for name, x, y in zip(names, ra, rb, strict=True):
        if x.shape != y.shape:
            return f"output '{name}': shape {y.shape} != {x.shape}"
        if not np.allclose(y, x, rtol=rtol, atol=atol, equal_nan=True):
            err = float(np.max(np.abs(y.astype(np.float64) - x)))
            return f"output '{name}': max abs difference {err:.3g} (rtol {rtol}, atol {atol})"
    return None


def optimize_file(
    src: str | Path,
    dst: str | Path,
    *,
    level: str = "extended",
    report: str | Path | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-5,
    dims: Mapping[str, int] | None = None,
) -> list[PassRecord]:
    for path, what in ((dst, "output"), (report, "report")):
        if path is not None:
            _check_writable(Path(path), what)
    original = load(src)
    model = load(src)
    try:
        sess = _session(original)
    except Exception as exc:
        raise OptimizeError(
            f"{src}: ONNX Runtime cannot load the model: {first_line(exc)}"
        ) from exc
    feeds = random_feeds(sess, dims=dims)
    try:
        sess.run(None, feeds)
    except Exception as exc:
        sizes = {d: dict(dims or {}).get(d, DEFAULT_DIM) for d in symbolic_dims(sess)}
        raise OptimizeError(
            f"{src}: ONNX Runtime cannot run the model on random inputs with symbolic "
            f"dimensions {sizes} (set them with --dim NAME=SIZE): {first_line(exc)}"
        ) from exc
    pipeline = passes(level)
    records = run_pipeline(model, pipeline)
    problem = _outputs_match(original, model, feeds, rtol, atol)
    if problem is not None:
        blame = _blame(src, pipeline, feeds, rtol, atol)
        raise OptimizeError(f"outputs changed after pass '{blame}': {problem}")
    try:
        ir.save(model, dst)
        if report is not None:
            Path(report).write_text(json.dumps([r.__dict__ for r in records], indent=1))
    except OSError as exc:
        raise OptimizeError(f"cannot write {exc.filename or dst}: {exc.strerror or exc}") from exc
    return records


def _check_writable(path: Path, what: str) -> None:
    """Before any work: the folder exists and a file can be created in it (a missing
    folder, a file in its place or a read-only filesystem fail here, in one line)."""
    folder = path.parent
    if not folder.is_dir():
        problem = "is not a folder" if folder.exists() else "does not exist"
        raise OptimizeError(f"{what} {path}: folder {folder} {problem}")
    try:
        probe = tempfile.NamedTemporaryFile(dir=folder, prefix=".ortrain-write-check-")
        probe.close()
    except OSError as exc:
        raise OptimizeError(f"{what} {path}: cannot write in {folder}: {exc.strerror}") from exc


def _blame(src, pipeline: Sequence[Pass], feeds: dict, rtol: float, atol: float) -> str:
    reference = load(src)
    model = load(src)
    for p in pipeline:
        run_pipeline(model, [p])
        if _outputs_match(reference, model, feeds, rtol, atol) is not None:
            return p.name
    return pipeline[-1].name


def summary(records: Sequence[PassRecord]) -> str:
    return format_table(records)
