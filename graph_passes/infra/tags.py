"""Metadata keys the passes put on nodes, so later passes read roles instead of names."""

from __future__ import annotations

import onnx_ir as ir

GRAD_OF = "ortrain.grad_of"  # on backward nodes: the forward node they differentiate
RECOMPUTE_OF = "ortrain.recompute_of"  # on recomputed copies: the forward node copied
# on an embedding's Gather: the row whose gradient is 0 (torch's ``padding_idx``)
PADDING_IDX = "ortrain.padding_idx"
# on a node whose inputs from this index on (a decimal string) only order it after their
# producers and read no data (``targets/cpu/update_in_backward.py``'s AdamStep)
ORDERING_INPUTS_FROM = "ortrain.ordering_inputs_from"
# on an empty Slice that is a graph output only to make ONNX Runtime run its input early
# (``targets/cpu/scatter_in_place.py``)
EARLY_LEAF = "ortrain.early_leaf"


def is_backward(node: ir.Node) -> bool:
    return GRAD_OF in node.metadata_props
