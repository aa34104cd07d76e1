"""Forward cleanup before autodiff: constant folding, CSE and dead-code removal.

onnxscript's optimizer does all three (with its default no-op rewrites: identity
Reshape/Cast/Expand, collapsed Slices): constant subexpressions the exporter left
(shape arithmetic, causal masks built from ``arange``) become initializers, so autodiff
never sees them. Parameters are graph inputs, never initializers, so no weight is
folded into a constant. The size limits keep big constants computed: folding a
[seq, seq] mask is fine, folding a broadcast [batch, heads, seq, seq] one would add
megabytes to the model.

Run it after ``seed_dropouts``: every Dropout then carries its own seed, so CSE cannot
merge two independent Dropouts that read one input.

The pass list is onnxscript's ``optimize_ir`` with three changes: nothing that draws random
numbers is folded (``not_random``); its no-op rules match the
constant with a tolerance (``x + 0`` also matches ``x + 1e-12``, which deleted a
LayerNorm's epsilon and divided by a zero variance), so here ``x + c``, ``x - c``, ``x * c``
and ``x / c`` are dropped only for a one-element ``c`` exactly 0 or 1 that does not
broadcast ``x``; and its rule that replaces a ScatterND writing every row by its updates
also took a ScatterND that adds (``index_add`` or ``index_put(accumulate=True)`` over every
row: the data it adds to was dropped, with its gradient), so here it takes only a
ScatterND that replaces.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript import rewriter
from onnxscript.optimizer import _constant_folding
from onnxscript.rewriter import pattern
from onnxscript.rewriter.rules.common import _no_op, _redundant_scatter_nd

from ortrain.core.names import RANDOM_OPS
from ortrain.graph_passes.cleanup.keep_input_names import KeepInputNamesPass
from ortrain.graph_passes.infra.constant_value import constant_tensor
from ortrain.graph_passes.infra.rule_index import by_root

FOLD_INPUT_LIMIT = 8192  # elements: larger constant inputs are not folded
FOLD_OUTPUT_LIMIT = 1 << 20  # elements: folded results larger than this are not kept


def clean_forward(model: ir.Model) -> bool:
    """Fold, rewrite, deduplicate and remove in place; returns whether anything changed."""
    unseeded = [
        n.name for n in model.graph if n.op_type == "Dropout" and "seed" not in n.attributes
    ]
    if unseeded:
        raise ValueError(
            f"clean_forward: Dropout nodes {unseeded[:3]} have no seed; run seed_dropouts "
            "first or CSE may merge independent masks"
        )
    cleanup = ir.passes.Sequential(
        common_passes.InlinePass(),
        ir.passes.PassManager(
            [
                _constant_folding.FoldConstantsPass(
                    shape_inference=True,
                    input_size_limit=FOLD_INPUT_LIMIT,
                    output_size_limit=FOLD_OUTPUT_LIMIT,
                    should_fold=not_random,
                ),
                rewriter.RewritePass(by_root(CLEANUP_RULES)),
                common_passes.RemoveUnusedNodesPass(),
                common_passes.RemoveUnusedFunctionsPass(),
                common_passes.RemoveUnusedOpsetsPass(),
            ],
            steps=2,
            early_stop=True,
        ),
        common_passes.RemoveUnusedNodesPass(),
        common_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common_passes.LiftSubgraphInitializersToMainGraphPass(),
        common_passes.DeduplicateInitializersPass(),
        common_passes.CommonSubexpressionEliminationPass(),
        common_passes.OutputFixPass(),
        KeepInputNamesPass(),
        common_passes.NameFixPass(),
    )
    with quiet_folding():
        return cleanup(model).modified


@contextlib.contextmanager
def quiet_folding() -> Iterator[None]:
    """The folder's warnings off: where onnx's reference kernel cannot evaluate a node
    (an index only a branch not taken would read), it leaves the node to run at each
    step, and its "Evaluation failed: ..." told the user of a failure that is none."""
    logger = logging.getLogger(_constant_folding.__name__)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def not_random(node: ir.Node) -> bool | None:
    """Never fold an op that draws (None: the folder's own rules decide). onnxscript's
    folder skips its Random* ops but evaluates a training Dropout or a Bernoulli whose
    inputs are constants: one mask drawn at build time, the same at every step (Funnel's
    dropout of its sinusoid position embeddings)."""
    return False if node.op_type in RANDOM_OPS else None


class ExactNoOp(pattern.RewriteRuleClassBase):
    """``x op c`` → ``x`` where ``c`` is exactly the identity element of ``op``."""

    def __init__(self, op_type: str, identity: float):
        super().__init__(name=f"Exact{op_type}{identity:g}")
        self.op_type, self.identity = op_type, identity

    def pattern(self, op, x, c):
        return getattr(op, self.op_type)(x, c)

    def check(self, context, x, c) -> pattern.MatchResult:
        result = pattern.MatchResult()
        t = constant_tensor(c)
        if t is None:
            return result.fail("not a constant", c)
        arr = np.asarray(t.numpy())
        if arr.size != 1 or float(arr.reshape(-1)[0]) != self.identity:
            return result.fail(f"not exactly {self.identity:g}", c)
        if x.shape is None or len(arr.shape) > len(x.shape):
            return result.fail("the constant may broadcast x", c)
        return result

    def rewrite(self, op, x, c):
        return op.Identity(x)


_EXACT_NO_OPS = [
    *ExactNoOp.rule("Add", 0.0).commute(),
    *ExactNoOp.rule("Mul", 1.0).commute(),
    ExactNoOp.rule("Sub", 0.0),
    ExactNoOp.rule("Div", 1.0),
]


def _arithmetic(rule: pattern.RewriteRule) -> bool:
    """Whether one of onnxscript's no-op rules is x+0, x-0, x*1 or x/1 (tolerant matches;
    tests/test_passes.py checks that ``x + 1e-12`` survives, should this stop finding them)."""
    root = rule._target_pattern.outputs[0].producer()
    return root is not None and root.op_type in ("Add", "Sub", "Mul", "Div")


class ReplacingScatterAll(_redundant_scatter_nd.ScatterAllStatic):
    """``ScatterND(data, every row, updates)`` → ``updates``, only where the scatter
    replaces (module docstring): with ``reduction`` add, mul, max or min the result
    depends on ``data`` too."""

    def check(self, context, data, indices, updates, **_) -> pattern.MatchResult:
        reduction = context.root.attributes.get_string("reduction", "none")
        if reduction != "none":
            return pattern.MatchResult().fail(f"the scatter reduces ({reduction})", updates)
        return super().check(context, data, indices, updates)


_TOLERANT = {id(r) for r in _no_op.rules.rules if _arithmetic(r)}
_REPLACED = {id(_redundant_scatter_nd.no_op_static_scatter_nd_rule)}
CLEANUP_RULES = (
    *_EXACT_NO_OPS,
    ReplacingScatterAll.rule(),
    # not onnxscript's SlicesSplit: a two-output pattern, whose matcher tries every Slice
    # against every other and indexes the whole graph for each (minutes on a model that
    # slices a lot: a chunked linear attention written out), and which never fires on
    # the exporter's Slices (they carry steps and an open end)
    *(
        r
        for r in rewriter._DEFAULT_REWRITE_RULES
        if id(r) not in _TOLERANT | _REPLACED and r.name != "SlicesSplit"
    ),
)
