"""Mark the exported embedding lookups that have a ``padding_idx``.

``F.embedding(weight, ids, padding_idx=p)`` leaves row ``p`` of the weight out of the
gradient (BERT, RoBERTa, OPT, BART... all pass their pad token), but the ONNX export is a
plain ``Gather``: without the mark, ortrain's gradient would train the pad row that eager
keeps fixed. Each such Gather gets ``tags.PADDING_IDX`` in its metadata, and the Gather
gradient rule drops the updates of that row.

The exporter records each node's FX call (``pkg.torch.onnx.fx_node``), whose third
argument is the padding index; without that record, an ``nn.Embedding`` module named in
the node's scope is used.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import onnx_ir as ir

# aten.embedding(weight, indices, padding_idx=-1, ...): positional, or a keyword.
_FX_EMBEDDING = re.compile(
    r"aten\.embedding\.default\]\((?:args = \(%[\w.]+, %[\w.]+, (-?\d+)|.*padding_idx: (-?\d+))"
)


def tag_padding_rows(model: ir.Model, module: torch.nn.Module) -> int:
    """Returns the number of Gathers marked."""
    from ortrain.graph_passes.autodiff.builder import node_scope
    from ortrain.graph_passes.infra.tags import PADDING_IDX

    params = {id(p): n for n, p in module.named_parameters()}
    by_scope = {
        path: (params.get(id(m.weight)), m.padding_idx)
        for path, m in module.named_modules()
        if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None
    }
    count = 0
    for node in model.graph:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or not node.inputs:
            continue
        if node.attributes.get_int("axis", 0) != 0 or node.inputs[0] is None:
            continue
        fx = node.metadata_props.get("pkg.torch.onnx.fx_node")
        if fx is not None:
            match = _FX_EMBEDDING.search(fx)
            idx = int(match.group(1) or match.group(2)) if match else -1
        else:
            weight, idx = by_scope.get(node_scope(node).removeprefix("module."), (None, -1))
            idx = idx if weight == node.inputs[0].name else -1
        if idx >= 0:
            node.metadata_props[PADDING_IDX] = str(idx)
            count += 1
    return count
