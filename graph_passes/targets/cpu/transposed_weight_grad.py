"""A vocabulary-sized weight gradient made in the product's faster orientation.

An LM head's weight gradient is ``dW = dY^T X`` (``Gemm(dY, X, transA=1)``, dY the logit
gradient [tokens, vocab], X the head's input [tokens, hidden]). ONNX Runtime's MLAS runs
that product by transposing 12-row panels of dY for every 128 output columns, each panel
read across all the token rows of a [tokens, vocab] matrix (one page per row), which makes
it much slower than the same work as ``dW^T = X^T dY`` (``Gemm(X, dY, transA=1)``, X's
panels are small). The gain grows with the rows of ``dW`` and is lost in noise on small
tables, so only weight gradients of ``CpuCostModel.transposed_grad_min_rows`` rows or more
are rewritten: a cost threshold on the product's size, whatever the weight is.

Where the gradient's only reader is the parameter's update in the backward
(``update_in_backward.py``; through the tied table's row scatter-add, which then adds to
columns), nothing needs ``dW`` in the parameter's layout: the product makes ``dW^T``, the
scatter becomes ``ortrain.cpu.ScatterAddColumns`` and the update reads the gradient
transposed (``AdamStep``'s ``grad_transposed``: tiles of ``dW^T`` gathered in cache,
the same arithmetic, bit-identical results). The early leaf ``scatter_in_place.py`` may
hang on ``dW`` (an empty slice tagged ``EARLY_LEAF``) only changes its declared shape.
Anything else (the gradient a graph output, another reader, a ``C`` input, ``transB``)
stays as it is.
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.core.names import CPU_DOMAIN
from ortrain.graph_passes.infra.tags import EARLY_LEAF
from ortrain.graph_passes.targets.cpu.cost_model import CpuCostModel, cost_or_default

__all__ = ["transpose_weight_gradients"]

_STD = ("", "ai.onnx")


def transpose_weight_gradients(model: ir.Model, cost: CpuCostModel | None = None) -> int:
    """Returns the number of weight gradients now made transposed (``cost`` None: this
    machine's model)."""
    rows = cost_or_default(cost).transposed_grad_min_rows
    count = 0
    for node in list(model.graph):
        site = _site(node, rows)
        if site is None:
            continue
        scatter, update, leaves = site
        a, b = node.inputs[0], node.inputs[1]
        node.replace_input_with(0, b)
        node.replace_input_with(1, a)
        out = node.outputs[0]
        assert out.shape is not None
        out.shape = ir.Shape([out.shape[1], out.shape[0]])
        for leaf in leaves:  # value[0:0] along axis 0, of the new layout
            leaf.outputs[0].shape = ir.Shape([0, out.shape[1]])
        if scatter is not None:
            scatter.op_type = "ScatterAddColumns"
            scatter.outputs[0].shape = ir.Shape(out.shape)
        update.attributes["grad_transposed"] = ir.AttrInt64("grad_transposed", 1)
        count += 1
    return count


def _is_leaf(node: ir.Node) -> bool:
    """``scatter_in_place.py``'s early leaf: an empty slice no node reads."""
    out = node.outputs[0]
    return (
        node.op_type == "Slice"
        and node.domain in _STD
        and EARLY_LEAF in node.metadata_props
        and out.is_graph_output()
        and not list(out.uses())
    )


def _only_use(value: ir.Value) -> tuple[tuple[ir.Node, int], list[ir.Node]] | None:
    """((reader, input index), early leaves) where ``value`` has exactly one reader
    besides early leaves and is no graph output."""
    if value.is_graph_output():
        return None
    uses = list(value.uses())
    leaves = [node for node, index in uses if index == 0 and _is_leaf(node)]
    others = [(node, index) for node, index in uses if node not in leaves]
    if len(others) != 1:
        return None
    return others[0], leaves


def _is(node: ir.Node, op_type: str) -> bool:
    return node.op_type == op_type and node.domain == CPU_DOMAIN


def _site(node: ir.Node, min_rows: int) -> tuple[ir.Node | None, ir.Node, list[ir.Node]] | None:
    """(the row scatter or None, the update, early leaves on dW) where ``node`` makes a
    weight gradient that can be made transposed, else None."""
    if node.op_type != "Gemm" or node.domain not in _STD or len(node.inputs) != 2:
        return None
    if node.attributes.get_int("transA", 0) != 1 or node.attributes.get_int("transB", 0) != 0:
        return None
    out = node.outputs[0]
    dims = out.shape.dims if out.shape is not None else ()
    if len(dims) != 2 or not all(isinstance(d, int) for d in dims) or dims[0] < min_rows:
        return None
    if out.dtype != ir.DataType.FLOAT:
        return None
    use = _only_use(out)
    if use is None:
        return None
    (reader, index), leaves = use
    scatter = None
    if _is(reader, "ScatterAddRows") and index == 0:
        scatter = reader
        after = _only_use(reader.outputs[0])
        if after is None or after[1]:
            return None
        reader, index = after[0]
    if not _is(reader, "AdamStep") or index != 1:
        return None
    param = reader.inputs[0]
    if param is None or param.shape is None or tuple(param.shape.dims) != tuple(dims):
        return None
    return scatter, reader, leaves
