"""The exporter's cleanup of its own output, without its ways of changing the math.

``torch.onnx``'s ``ONNXProgram.optimize()`` runs onnxscript's ``optimize_ir``: constant
folding, the default rewrite rules, dead code, CSE. Three of those change what a training
graph computes:

- its no-op rules match ``x + 0`` within an absolute tolerance of 1e-8, so an RMSNorm's
  ``rsqrt(mean(x²) + 1e-8)`` lost its epsilon, and a row of zeros (a padded position,
  a padding embedding) divided by zero: NaN losses (Helium's default ``rms_norm_eps``);
- its CSE merges two Dropouts of one input (ONNX Runtime's Dropout is random, but onnx_ir
  treats only the Random* ops as such), so ``dropout(h) * dropout(h)`` drew one mask
  where eager draws two;
- its folder evaluates a training Dropout of a constant (Funnel drops out its sinusoid
  position embeddings): one mask drawn at build time, the same at every step.

Here: the same folding with nothing that draws folded, dead-code removal, and
``forward_cleanup``'s exact no-op rules; no CSE (``clean_forward`` runs it once every
Dropout carries its own seed).
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript import rewriter
from onnxscript.optimizer import _constant_folding

from ortrain.graph_passes.cleanup.forward_cleanup import CLEANUP_RULES, not_random, quiet_folding
from ortrain.graph_passes.cleanup.keep_input_names import KeepInputNamesPass
from ortrain.graph_passes.infra.rule_index import by_root


def clean_export(model: ir.Model) -> bool:
    """Fold constants, drop exact no-ops and dead code in place; whether anything changed."""
    cleanup = ir.passes.Sequential(
        common_passes.InlinePass(),
        ir.passes.PassManager(
            [
                _constant_folding.FoldConstantsPass(
                    shape_inference=True,
                    input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
                    output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
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
        common_passes.OutputFixPass(),
        KeepInputNamesPass(),
        common_passes.NameFixPass(),
    )
    with quiet_folding():
        return cleanup(model).modified
