"""Padding exactness proven on the exported training forward, not sampled.

Bucketing (``ortrain/bucketing.py``) appends padding on the right of a batch's sequence
axis. That is exact when no real position's value, the loss or a buffer update depends on
what the padded positions hold. ``prove`` follows the padded positions through the graph
(an abstract interpretation): every value knows which of its axes carry the padded
sequence (through reshapes, transposes, merged batch and sequence axes) and what its padded
*blocks* hold (a constant, a "masked" large negative score, or anything), and whether its
real block is the unpadded run's. Ops that mix positions read the blocks:

- a reduction over the padded axis is exact for a sum of zeros, a max of masked scores,
  never for a mean (its count includes the padding);
- a softmax over it needs masked scores there; a matmul contracting it needs zeros on one
  side (attention probabilities after a masked softmax);
- normalisation statistics over it (BatchNorm in training, LayerNorm over positions) and
  a read of a fixed position past the real ones (the last) mix padding in;
- a loss skips padded rows when their labels are its ``ignore_index``;
- a convolution along it reads padding unless the padding holds zeros (as its own zero
  padding) or the convolution is causal.

The verdict is "mixes" (with the node, op and module scope that mixes padding into what
the loss or a buffer update reads), "exact", or "unknown" (an op the analysis does not
model: the eager check decides alone). What "exact" assumes: values whose length comes
from the graph's static shape (a causal mask, a position table's rows) hold at each
position what the shorter run holds there; activations are finite and far smaller than a
masked score; every real query row attends to at least one real key (right padding: its
first token).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ortrain.padding.contents import ANY, Const
from ortrain.padding.values import Axis, Proof, Val, shape_of
from ortrain.padding.walk import Walk

if TYPE_CHECKING:
    import onnx_ir as ir

    from ortrain.core.roles import GraphIO


def prove(
    model: ir.Model,
    io: Sequence[GraphIO],
    outputs: Sequence[str],
    padded: Mapping[str, float | None],
    length: int,
) -> Proof:
    """Whether appending padding on the right of axis 1 of the batch inputs ``padded``
    (name -> what the padding holds: a number, or None for anything, e.g. token ids)
    changes what the graph's ``outputs`` (the loss, buffer updates) are, for any real
    length up to ``length``."""
    from ortrain.core.roles import Role

    walk = Walk(model)
    batch = {r.name for r in io if r.role is Role.BATCH}
    graph = model.graph
    for v in graph.inputs:
        if v.name not in padded or v.name not in batch:
            continue
        shape = shape_of(v)
        if shape is None or len(shape) < 2 or shape[1] != length:
            return Proof("unknown", f"batch input '{v.name}' has no static [batch, length]")
        value = padded[v.name]
        pad = ANY if value is None else Const(float(value))
        ax = Axis(length)
        walk.vals[id(v)] = Val(shape, {1: ax}, {frozenset(): ANY, frozenset({1}): pad})
    by_name = {v.name: v for v in graph.outputs}
    wanted = [by_name[n] for n in outputs if n in by_name]
    try:
        return walk.run(wanted)
    except Exception as exc:  # a form the rules did not foresee: the eager check decides
        return Proof("unknown", f"the analysis failed: {type(exc).__name__}: {exc}")
