"""Rewrite rule sets that try a rule only at nodes of its pattern's root op type.

onnxscript's ``RewriteRuleSet`` tries every rule at every node. A rule whose pattern
ends in one node of a fixed op type can only match at a node of that type (the matcher
starts there and fails at once elsewhere), but each of those failed tries walks the
matcher's call chain, and a training graph's fusions make tens of thousands of them: on
a small graph they cost more than the matches. Here each such rule is a copy whose
``try_rewrite`` returns at once where the op type differs; a rule whose root is not one
fixed op (a pattern of several outputs, an op given by a pattern, another matcher) is
kept as it is.

The root is read from onnxscript's pattern objects (``_target_pattern``, ``_matcher``),
which are not public API: if they change, ``root_op_type`` answers None and every rule
is tried everywhere as before (slower, the same result; tests/test_rule_index.py notices).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter._matcher import SimplePatternMatcher
from onnxscript.rewriter._pattern_ir import StringConstantPattern


def root_op_type(rule: pattern.RewriteRule) -> str | None:
    """The op type every node the rule can rewrite at has, or None where it is not one."""
    target = getattr(rule, "_target_pattern", None)
    if not isinstance(getattr(rule, "_matcher", None), SimplePatternMatcher) or target is None:
        return None
    nodes = getattr(target, "output_nodes", None)
    if not nodes or len(nodes) != 1:
        return None
    op = getattr(nodes[0], "op", None)
    return op.value() if isinstance(op, StringConstantPattern) else None


def _guarded(rule: pattern.RewriteRule, op_type: str) -> pattern.RewriteRule:
    tries = rule.try_rewrite

    def try_rewrite(model: ir.Model, graph: ir.Graph | ir.Function, node: ir.Node, **kw):
        return tries(model, graph, node, **kw) if node.op_type == op_type else None

    guarded = copy.copy(rule)
    guarded.try_rewrite = try_rewrite  # type: ignore[method-assign]
    return guarded


def by_root(
    rules: Iterable[pattern.RewriteRule] | pattern.RewriteRuleSet, *, commute: bool = False
) -> pattern.RewriteRuleSet:
    """The rules (commuted first where asked) as a set whose rules are tried only at
    their root op type, in the same order."""
    if isinstance(rules, pattern.RewriteRuleSet):
        expanded = list(rules.rules)
    else:
        expanded = list(pattern.RewriteRuleSet(list(rules), commute=commute).rules)
    out = []
    for rule in expanded:
        op_type = root_op_type(rule)
        out.append(rule if op_type is None else _guarded(rule, op_type))
    return pattern.RewriteRuleSet(out)
