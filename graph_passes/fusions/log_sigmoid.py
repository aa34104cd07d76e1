"""``Log(Sigmoid(x))`` (how the exporter writes ``F.logsigmoid``) as ``-Softplus(-x)``.

ONNX Runtime's Sigmoid rounds to 0 below x of about -20 (and is an approximation in its
tail), so the log became -inf and its gradient NaN where eager's logsigmoid gives about
x. ``-softplus(-x)`` is the same function, and ONNX Runtime's Softplus stays finite and
exact there. A numerical fix, not an optimization: it runs in every build.
Kept: a Sigmoid read by anything besides the Log (the rewrite would compute it twice).
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from ortrain.graph_passes.infra.rule_index import by_root


def _pattern(op, x):
    return op.Log(op.Sigmoid(x, _outputs=["sig"]))


def _check(context, x, sig, **_) -> pattern.MatchResult:
    result = pattern.MatchResult()
    if len(sig.uses()) != 1 or sig.is_graph_output():
        return result.fail("the Sigmoid is read elsewhere", sig)
    return result


def _replacement(op, x, **_):
    return op.Neg(op.Softplus(op.Neg(x)))


RULES = pattern.RewriteRuleSet(
    [pattern.RewriteRule(_pattern, _replacement, _check, name="LogSigmoidAsSoftplus")]
)


def stable_log_sigmoid(model: ir.Model) -> int:
    """Returns the number of ``Log(Sigmoid(x))`` rewritten."""
    return by_root(RULES).apply_to_model(model)
