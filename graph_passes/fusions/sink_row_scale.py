"""Move a per-row scale off a wide operand of the gradient products it feeds.

The cross-entropy gradient is ``(softmax - onehot) * c`` with one coefficient per row
(``c``: [N, 1], 1 / labelled rows times the loss scale, 0 for ignored rows), and the
LM head's two gradient products are its only readers. A row scale commutes with a
product, so it can move to the products' narrow side:

    Gemm(c*X, B)                 = c * Gemm(X, B)          (the input's gradient, [N, K])
    Gemm(c*X, B, transA=1)       = Gemm(X, c*B, transA=1)  (the weight gradient, [V, K])
    Gemm(A, c*X)                 = Gemm(A*c^T, X)
    Gemm(A, c*X, transB=1)       = Gemm(A, X, transB=1) * c^T

The [N, V] tensor (vocabulary wide) is then not written a second time: one full pass
over it less (gpt2-tiny: its gradient graph ran faster, interleaved A/B).

A gradient ``Mul(X, c)`` is rewritten when ``c`` has X's shape with a last dimension of
1, every reader of the product is a 2-D Gemm without C (directly or through Reshapes
that keep the last dimension), and the scaled operands are smaller in total than X.
Anything else (a reader that is not a Gemm, a Gemm with C, a per-column scale, a graph
output on the way) is left alone.
"""

from __future__ import annotations

import functools
import math

import onnx_ir as ir

from ortrain.graph_passes.cleanup.fold_transpose_gemm import replace_node
from ortrain.graph_passes.infra.tags import is_backward

_STD = ("", "ai.onnx")


def _static(v: ir.Value | None) -> tuple[int, ...] | None:
    if v is None or v.shape is None or not all(isinstance(d, int) for d in v.shape.dims):
        return None
    return tuple(int(d) for d in v.shape.dims)


def _is(node: ir.Node, op_type: str) -> bool:
    return node.op_type == op_type and node.domain in _STD


def _row_scale(node: ir.Node) -> tuple[ir.Value, ir.Value] | None:
    """(X, c) when ``node`` is ``Mul(X, c)`` (either order) with c X's shape but last dim 1."""
    if not _is(node, "Mul") or len(node.inputs) != 2:
        return None
    for x, c in (node.inputs, node.inputs[::-1]):
        xs, cs = _static(x), _static(c)
        if xs and cs and len(xs) >= 2 and cs == (*xs[:-1], 1) and xs[-1] > 1:
            return x, c
    return None


def _gemm_readers(
    v: ir.Value, width: int, chain: list[ir.Node]
) -> list[tuple[ir.Node, int]] | None:
    """The (Gemm, operand index) pairs reading ``v`` through shape-only Reshapes that keep
    the last dimension (appended to ``chain``); None if anything else reads it, a Gemm
    has C or is not 2-D, or a value on the way is a graph output."""
    if v.is_graph_output():
        return None
    found: list[tuple[ir.Node, int]] = []
    for user, idx in v.uses():
        if _is(user, "Gemm") and idx < 2 and all(g is not user for g, _ in found):
            has_c = len(user.inputs) > 2 and user.inputs[2] is not None
            shape = _static(v)
            if has_c or shape is None or len(shape) != 2:
                return None
            found.append((user, idx))
        elif _is(user, "Reshape") and idx == 0:
            shape = _static(user.outputs[0])
            if shape is None or shape[-1] != width:
                return None
            chain.append(user)
            deeper = _gemm_readers(user.outputs[0], width, chain)
            if deeper is None:
                return None
            found += deeper
        else:
            return None
    return found


class _Emitter:
    """New gradient nodes placed before ``anchor``, tagged like the Mul they replace."""

    def __init__(self, graph: ir.Graph, tags: dict[str, str], base: str):
        self.graph, self.tags, self.base, self.n = graph, tags, base, 0

    def node(self, op: str, inputs: list[ir.Value], anchor: ir.Node, shape, dtype, **attrs):
        self.n += 1
        name = f"{self.base}/sunk_{self.n}"
        node = ir.Node(
            "",
            op,
            inputs,
            attributes=ir.convenience.convert_attributes(attrs),
            name=name,
            metadata_props=dict(self.tags),
        )
        out = node.outputs[0]
        out.name, out.dtype, out.shape = name, dtype, ir.Shape(list(shape))
        self.graph.insert_before(anchor, node)
        return node

    def reshape(self, v: ir.Value, shape: tuple[int, ...], *, anchor: ir.Node) -> ir.Value:
        if _static(v) == shape:
            return v
        const = ir.Value(name=f"{self.base}/shape_{self.n + 1}", const_value=ir.tensor(
            list(shape), dtype=ir.DataType.INT64))  # fmt: skip
        const.shape, const.dtype = ir.Shape([len(shape)]), ir.DataType.INT64
        self.graph.register_initializer(const)
        return self.node("Reshape", [v, const], anchor, shape, v.dtype).outputs[0]


def _rewrite(
    graph: ir.Graph, mul: ir.Node, x: ir.Value, c: ir.Value, readers, chain: list[ir.Node],
    base: str,
) -> None:  # fmt: skip
    xs = _static(x)
    assert xs is not None
    rows, width = math.prod(xs[:-1]), xs[-1]
    emit = _Emitter(graph, dict(mul.metadata_props), base)
    for gemm, idx in readers:
        ta, tb = gemm.attributes.get_int("transA", 0), gemm.attributes.get_int("transB", 0)
        x2 = emit.reshape(x, (rows, width), anchor=gemm)
        # c laid along the rows of x2 ([rows, 1]) or along a row ([1, rows])
        along = functools.partial(emit.reshape, c, anchor=gemm)
        a, b = gemm.inputs[0], gemm.inputs[1]
        assert a is not None and b is not None
        if idx == 0 and ta == 1:  # x2^T B: scale B's rows (its columns if transposed)
            s = along((1, rows)) if tb else along((rows, 1))
            scaled = emit.node("Mul", [b, s], gemm, _static(b), b.dtype)
            gemm.replace_input_with(0, x2)
            gemm.replace_input_with(1, scaled.outputs[0])
        elif idx == 1 and tb == 0:  # A x2: scale A's columns (its rows if transposed)
            s = along((rows, 1)) if ta else along((1, rows))
            scaled = emit.node("Mul", [a, s], gemm, _static(a), a.dtype)
            gemm.replace_input_with(0, scaled.outputs[0])
            gemm.replace_input_with(1, x2)
        else:  # x2 B or A x2^T: scale the product's rows / columns
            out = gemm.outputs[0]
            product = emit.node("Gemm", [x2, b] if idx == 0 else [a, x2], gemm, _static(out),
                                out.dtype)  # fmt: skip
            for k, attr in gemm.attributes.items():
                product.attributes[k] = attr
            product.metadata_props.update(gemm.metadata_props)
            s = along((rows, 1)) if idx == 0 else along((1, rows))
            new = ir.Node("", "Mul", [product.outputs[0], s], name=f"{gemm.name}/row_scaled",
                          metadata_props=dict(mul.metadata_props))  # fmt: skip
            replace_node(graph, gemm, new, gemm)
    for node in [*reversed(chain), mul]:  # now without readers, deepest first
        if not any(o.uses() for o in node.outputs):
            graph.remove(node, safe=True)


def _cost(readers) -> int:
    """Elements the moved scale multiplies: the other operand or the product."""
    total = 0
    for gemm, idx in readers:
        ta, tb = gemm.attributes.get_int("transA", 0), gemm.attributes.get_int("transB", 0)
        if (idx == 0 and ta == 1) or (idx == 1 and tb == 0):
            other = _static(gemm.inputs[1 - idx])
        else:
            other = _static(gemm.outputs[0])
        if other is None:
            return -1
        total += math.prod(other)
    return total


def sink_row_scales(model: ir.Model) -> int:
    """Rewrite every gradient row-scale ``Mul`` that qualifies; returns how many."""
    graph = model.graph
    count = 0
    for node in list(graph):
        if node.graph is None or not is_backward(node):
            continue
        found = _row_scale(node)
        if found is None:
            continue
        x, c = found
        xs = _static(x)
        assert xs is not None
        chain: list[ir.Node] = []
        readers = _gemm_readers(node.outputs[0], xs[-1], chain)
        if not readers:
            continue
        cost = _cost(readers)
        if cost < 0 or cost >= math.prod(xs):
            continue
        _rewrite(graph, node, x, c, readers, chain, f"{node.name or 'row_scale'}.{count}")
        count += 1
    return count
