"""Rule sets tried only at their rules' root op type (graph_passes/infra/rule_index.py):
every rule of the passes has a root, and the indexed sets rewrite what the plain ones do."""

from __future__ import annotations

import collections

import onnx_ir as ir
import pytest
import torch
from onnxscript.rewriter import _rewrite_rule, pattern
from onnxscript.rewriter.ort_fusions.rms_normalization import rms_normalization_ruleset

from ortrain.export import export_forward
from ortrain.graph_passes.cleanup.forward_cleanup import CLEANUP_RULES
from ortrain.graph_passes.fusions import (
    bias_gelu,
    gelu,
    layer_norm,
    log_sigmoid,
    matmul_add,
    matmul_transpose,
    skip_layer_norm,
)
from ortrain.graph_passes.infra.rule_index import by_root, root_op_type
from tests.conftest import gpt2

RULE_SETS = {
    "cleanup": pattern.RewriteRuleSet(list(CLEANUP_RULES)),
    "gelu": gelu.rule_set(contrib=False),
    "gelu_contrib": gelu.rule_set(contrib=True),
    "matmul_transpose": matmul_transpose.RULES,
    "matmul_add": matmul_add.RULES,
    "bias_gelu": bias_gelu.RULES,
    "layer_norm": layer_norm.WITH_BIAS,
    "layer_norm_no_bias": layer_norm.WITHOUT_BIAS,
    "skip_layer_norm": skip_layer_norm.SKIP_LAYER_NORM_RULES,
    "skip_rms_norm": skip_layer_norm.SKIP_RMS_NORM_RULES,
    "log_sigmoid": log_sigmoid.RULES,
    "rms_norm": rms_normalization_ruleset,
}


@pytest.mark.parametrize("name", list(RULE_SETS))
def test_every_rule_of_the_passes_has_a_root_op_type(name):
    """Where onnxscript's pattern objects change, ``root_op_type`` answers None and the
    rules are tried everywhere again: right, but the rewriter's cost is back."""
    rules = RULE_SETS[name].rules
    roots = [root_op_type(r) for r in rules]
    assert None not in roots, [r.name for r, root in zip(rules, roots, strict=True) if not root]
    # the root is the op the matcher starts from: each pattern's single output node
    for rule, root in zip(rules, roots, strict=True):
        assert rule._target_pattern.output_node.op_type == root


def _copy(model: ir.Model) -> ir.Model:
    return ir.serde.deserialize_model(ir.serde.serialize_model(model))


def _ops(model: ir.Model) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph)


class _Chains(torch.nn.Module):
    """A GELU written out, a LayerNorm written out, x * 1 and a Log(Sigmoid) after a
    MatMul + bias: something for most of the sets to rewrite."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.w = torch.nn.Parameter(torch.ones(8))
        self.b = torch.nn.Parameter(torch.zeros(8))

    def forward(self, x):
        h = self.lin(x) * 1.0
        g = 0.5 * h * (1.0 + torch.tanh(0.7978845608 * (h + 0.044715 * h.pow(3))))
        mu = g.mean(-1, keepdim=True)
        var = (g - mu).pow(2).mean(-1, keepdim=True)
        n = (g - mu) / torch.sqrt(var + 1e-5) * self.w + self.b
        return torch.log(torch.sigmoid(n)).sum()


@pytest.mark.parametrize("which", ["gpt2", "chains"])
def test_indexed_sets_rewrite_what_the_plain_sets_rewrite(which, monkeypatch):
    """Each set applied in turn to one export, plain (every rule at every node) and
    indexed: the same rewrites, the same graph; the indexed rules are tried only at
    nodes of their root op type, and far less often."""
    if which == "gpt2":
        model = gpt2(layers=2, hidden=32, vocab=64)
        ids = torch.randint(0, 64, (2, 8))
        exported = export_forward(model, {"input_ids": ids, "labels": ids}, train=False).model
    else:
        exported = export_forward(_Chains(), {"x": torch.randn(3, 8)}, train=False).model
    tried: list[tuple[str, str]] = []
    original = _rewrite_rule.RewriteRule.try_rewrite

    def counted(self, model, graph, node, **kw):
        tried.append((self._target_pattern.output_node.op_type, node.op_type))
        return original(self, model, graph, node, **kw)

    monkeypatch.setattr(_rewrite_rule.RewriteRule, "try_rewrite", counted)
    results = {}
    for mode in ("plain", "indexed"):
        graph, counts = _copy(exported), []
        tried.clear()
        for rules in RULE_SETS.values():
            applied = by_root(rules) if mode == "indexed" else rules
            counts.append(applied.apply_to_model(graph))
        results[mode] = (counts, _ops(graph), len(tried))
        if mode == "indexed":
            assert all(root == op for root, op in tried), collections.Counter(
                pair for pair in tried if pair[0] != pair[1]
            )
    (plain_counts, plain_ops, plain_tries), (counts, ops, tries) = results.values()
    assert sum(plain_counts) > 0, "nothing to rewrite: the test checks nothing"
    assert counts == plain_counts and ops == plain_ops
    assert tries * 5 < plain_tries, (tries, plain_tries)
