"""Label sparsity: compute the loss head only on the rows that carry a label.

A masked-LM loss reads ~15% of its rows: every other label is ``ignore_index``, yet the
head (dense, GELU, LayerNorm and the [hidden x vocab] decoder GEMM) and the
log-softmax run on all of them — for BERT-tiny a third of the step. This pass gathers
the labelled rows just above the head, so the row-wise ops run on ``cap`` rows instead
of ``N`` (ONNX Runtime training's "label sparsity" compute optimization does the same).

The graph stays statically shaped (autodiff and the memory plan need static shapes):
``cap`` is a build parameter, chosen by the caller from the batch (at least the
number of labelled rows; ``label_rows_bucket``). TopK picks the labelled rows first,
then ignored ones as padding; padding rows keep their ``ignore_index`` label, so the
loss (mean or sum over labelled rows) is unchanged.

Cases: 1. ``SoftmaxCrossEntropyLoss`` with ``ignore_index``, reduction mean or sum,
scores [N, C] and labels [N] reshaped from one graph input, is a site
(``find_label_sites``); 2. the gather moves up through row-preserving reshapes and
row-wise ops (Gemm / MatMul / FusedMatMul with a 2-D weight, LayerNormalization over
the last axis, unary element-wise ops, element-wise ops with a per-column operand);
it stops at a value something else also reads, or at any other op (attention mixes
rows); 3. ``cap >= N``, a ``log_prob`` output in use, or nothing row-wise above the loss:
left alone.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common

from ortrain.core.names import LabelSite
from ortrain.graph_passes.infra.emitter import Emitter

MS_DOMAIN = "com.microsoft"
_STANDARD = ("", "ai.onnx")
_ROW_VIEWS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})
_UNARY = frozenset(
    {"Gelu", "FastGelu", "Relu", "Tanh", "Sigmoid", "Erf", "Cast", "Neg", "Exp", "Softplus"}
)
_BINARY = frozenset({"Add", "Sub", "Mul", "Div", "BiasGelu"})
_MAX_EXACT_ROWS = 1 << 24  # TopK keys are float32 row numbers


def _dims(v: ir.Value | None) -> tuple[int, ...] | None:
    if v is None or v.shape is None or not all(isinstance(d, int) for d in v.shape.dims):
        return None
    return tuple(int(d) for d in v.shape.dims)


def _labels_input(v: ir.Value, graph: ir.Graph) -> ir.Value | None:
    """The graph input that ``v`` is a reshape of (row-major order kept), else None."""
    inputs = set(graph.inputs)
    while v not in inputs:
        node = v.producer()
        if node is None or node.op_type not in _ROW_VIEWS or node.domain not in _STANDARD:
            return None
        v = node.inputs[0]
    return v


def find_label_sites(model: ir.Model) -> list[LabelSite]:
    sites = []
    for node in model.graph:
        if node.op_type != "SoftmaxCrossEntropyLoss" or node.domain not in _STANDARD:
            continue
        if not node.name:  # sites are keyed by node name
            continue
        ignore = node.attributes.get("ignore_index")
        reduction = node.attributes.get("reduction")
        if ignore is None or (reduction is not None and reduction.value == "none"):
            continue
        if len(node.outputs) > 1 and node.outputs[1].uses():
            continue
        scores, labels = _dims(node.inputs[0]), _dims(node.inputs[1])
        if scores is None or labels is None or len(scores) != 2 or labels != scores[:1]:
            continue
        source = _labels_input(node.inputs[1], model.graph)
        if source is None or scores[0] >= _MAX_EXACT_ROWS or _row_chain(node.inputs[0])[1] == []:
            continue
        sites.append(LabelSite(node.name, source.name, int(ignore.value), scores[0]))
    return sites


# --------------------------------------------------------------------------- the chain
def _per_column(v: ir.Value | None, width: int) -> bool:
    """A constant-over-rows operand: rank <= 1, or leading dims all 1, width 1 or ``width``."""
    d = _dims(v)
    return d is not None and all(x == 1 for x in d[:-1]) and (not d or d[-1] in (1, width))


def _row_input(node: ir.Node, out: ir.Value) -> int | None:
    """Which input of ``node`` carries the rows of ``out`` (others must not), else None."""
    shape = _dims(out)
    if shape is None or len(shape) < 2 or len(node.outputs) != 1:
        return None
    width = shape[-1]
    op, dom = node.op_type, node.domain
    attr = {k: a.value for k, a in node.attributes.items()}
    if op == "Gemm" and dom in _STANDARD:
        bias_ok = len(node.inputs) < 3 or _per_column(node.inputs[2], width)
        return 0 if not attr.get("transA", 0) and bias_ok else None
    if op == "MatMul" and dom in _STANDARD:
        return 0 if len(_dims(node.inputs[1]) or ()) == 2 else None
    if op == "FusedMatMul" and dom == MS_DOMAIN:
        batch_flags = ("transA", "transBatchA", "transBatchB")
        ok = not any(attr.get(k, 0) for k in batch_flags) and len(_dims(node.inputs[1]) or ()) == 2
        return 0 if ok else None
    if op == "LayerNormalization" and dom in _STANDARD:
        ok = attr.get("axis", -1) in (-1, len(shape) - 1) and all(
            _per_column(v, width) for v in node.inputs[1:] if v is not None
        )
        return 0 if ok else None
    if op in _UNARY and dom in (*_STANDARD, MS_DOMAIN):
        extra = [v for v in node.inputs[1:] if v is not None]  # FastGelu's bias
        return 0 if all(_per_column(v, width) for v in extra) else None
    if op in _BINARY and len(node.inputs) == 2:
        a, b = node.inputs
        if _dims(a) == shape and _per_column(b, width):
            return 0
        if _dims(b) == shape and _per_column(a, width) and op != "BiasGelu":
            return 1
    return None


def _row_chain(scores: ir.Value) -> tuple[ir.Value, list[tuple[ir.Node, int]]]:
    """Walk up from ``scores`` [N, C] through ops that keep rows apart.

    Returns the value to gather rows from and the row-wise nodes below it (top first)
    with their row input index. Reshapes that keep the last axis are passed over.
    """
    rows = (_dims(scores) or (0,))[0]
    chain: list[tuple[ir.Node, int]] = []
    v = scores
    while True:
        node = v.producer()
        if node is None:
            break
        if node.op_type in _ROW_VIEWS and node.domain in _STANDARD:
            src = _dims(node.inputs[0])
            out = _dims(v)
            if not src or not out or src[-1] != out[-1] or int(np.prod(src[:-1])) != rows:
                break
            nxt = node.inputs[0]
        else:
            k = _row_input(node, v)
            if k is None:
                break
            src = _dims(node.inputs[k])
            if src is None or int(np.prod(src[:-1])) != rows:
                break
            chain.append((node, k))
            nxt = node.inputs[k]
        if len(nxt.uses()) > 1 or nxt.is_graph_output() or nxt.producer() is None:
            v = nxt
            break
        v = nxt
    chain.reverse()
    return v, chain


# --------------------------------------------------------------------------- the rewrite
def shrink_label_rows(model: ir.Model, caps: Mapping[str, int]) -> int:
    """Gather ``caps[site.node]`` rows for each site; returns the number of sites shrunk."""
    graph = model.graph
    nodes = {n.name: n for n in graph}
    count = 0
    for site in find_label_sites(model):
        cap = caps.get(site.node)
        if cap is None or cap >= site.rows:
            continue
        sce = nodes[site.node]
        _shrink(graph, sce, site, cap)
        count += 1
    if count:
        ir.passes.common.RemoveUnusedNodesPass()(model)
    return count


def _shrink(graph: ir.Graph, sce: ir.Node, site: LabelSite, cap: int) -> None:
    em = Emitter(graph, f"{sce.name}/label_rows", dict(sce.metadata_props))
    n = site.rows
    labels = sce.inputs[1]
    # Labelled rows first (in row order), then ignored ones: key = valid * N - row.
    ignored = em.op("Equal", labels, em.const(site.ignore_index, labels.dtype), shape=[n])
    valid = em.op("Cast", em.op("Not", ignored, shape=[n]), to=ir.DataType.FLOAT.value, shape=[n])
    scaled = em.op("Mul", valid, em.const(n, ir.DataType.FLOAT), shape=[n])
    order = em.const(np.arange(n, dtype=np.float32).tolist(), ir.DataType.FLOAT)
    key = em.op("Sub", scaled, order, shape=[n])
    top_keys, rows = em.op_multi(
        "TopK", key, em.ints([cap]), axis=0, largest=1, sorted=1, num_outputs=2
    )
    top_keys.dtype, top_keys.shape = ir.DataType.FLOAT, ir.Shape([cap])
    rows.dtype, rows.shape = ir.DataType.INT64, ir.Shape([cap])
    new_labels = em.op("Gather", labels, rows, axis=0, shape=[cap])

    top, chain = _row_chain(sce.inputs[0])
    top_dims = _dims(top)
    assert top_dims is not None
    width = top_dims[-1]
    cur = top
    if len(top_dims) != 2:
        cur = em.op("Reshape", top, em.ints([n, width]), shape=[n, width])
    cur = em.op("Gather", cur, rows, axis=0, shape=[cap, width])
    for node, k in chain:
        out = node.outputs[0]
        out_width = (_dims(out) or (0,))[-1]
        inputs = list(node.inputs)
        inputs[k] = cur
        if node.op_type not in ("Gemm", "MatMul", "FusedMatMul"):
            # Per-column operands shaped [1, 1, D] for 3-D rows: [D] for 2-D ones.
            for j, v in enumerate(inputs):
                d = _dims(v)
                if j != k and d is not None and len(d) > 1:
                    inputs[j] = em.op("Reshape", v, em.ints(d[-1:]), shape=d[-1:])
        attrs = {name: a.value for name, a in node.attributes.items()}
        if node.op_type == "LayerNormalization":
            attrs["axis"] = -1  # rows are 2-D now
        clone = ir.Node(
            node.domain,
            node.op_type,
            inputs,
            attributes=ir.convenience.convert_attributes(attrs),
            name=f"{node.name}/label_rows" if node.name else em.fresh(f"node_{node.op_type}"),
            metadata_props=dict(node.metadata_props),
            version=node.version,
        )
        em.nodes.append(clone)
        cur = clone.outputs[0]
        cur.name = f"{out.name}/label_rows" if out.name else em.fresh(node.op_type)
        cur.dtype, cur.shape = out.dtype, ir.Shape([cap, out_width])
    em.flush_before(sce)
    sce.replace_input_with(0, cur)
    sce.replace_input_with(1, new_labels)
