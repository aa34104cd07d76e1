"""Index, gather and scatter ops: GatherElements, ScatterElements (reductions none, add,
max, min), ScatterND, TopK, Einsum.

Also the pure data movements Trilu, DepthToSpace, SpaceToDepth and ReverseSequence, whose
gradients apply the same movement (or its inverse) to the output gradient.
"""

from __future__ import annotations

import string

import numpy as np
import onnx_ir as ir

from ortrain.graph_passes.autodiff.context import GradContext
from ortrain.graph_passes.autodiff.registry import gradient, no_gradient
from ortrain.graph_passes.autodiff.rules.reduce_more import graph_opset

# Hardmax's one-hot output is piecewise constant in its input.
no_gradient("Hardmax")


def _axis(ctx: GradContext, default: int = 0) -> int:
    return int(ctx.attr("axis", default)) % ctx.rank(ctx.I(0))


def _scatter_add_opset(ctx: GradContext) -> None:
    """ScatterElements takes ``reduction`` (here "add") from opset 16 on."""
    if graph_opset(ctx) < 16:
        raise NotImplementedError(
            f"the gradient of {ctx.node.op_type} needs ScatterElements(reduction='add'), "
            f"opset 16 or later; the model imports opset {graph_opset(ctx)}"
        )


def _reduction(ctx: GradContext) -> str:
    red = str(ctx.attr("reduction", "none"))
    if red not in ("none", "add"):
        raise NotImplementedError(f"{ctx.node.op_type} with reduction={red!r}")
    return red


# --- gathers and scatters --------------------------------------------------------------


@gradient("GatherElements", nondiff_inputs=(1,))
def gather_elements(ctx: GradContext):
    # Repeated indices read one element several times: their gradients must add up.
    _scatter_add_opset(ctx)
    x, axis = ctx.I(0), _axis(ctx)
    zeros = ctx.zeros(ctx.shape(x), ctx.GO(0).dtype)
    out = ctx.op(
        "ScatterElements", zeros, ctx.I(1), ctx.GO(0), axis=axis, reduction="add",
        shape=ctx.shape(x),
    )  # fmt: skip
    return {0: out}


def _scatter_extremum(ctx: GradContext) -> dict:
    """ScatterElements with reduction max / min (``scatter_reduce`` amax / amin): as
    torch, each position's gradient is split evenly among the elements equal to its
    result, data's and the updates written there."""
    _scatter_add_opset(ctx)
    axis, g, idx = _axis(ctx), ctx.GO(0), ctx.I(1)
    data, updates, out = ctx.I(0), ctx.I(2), ctx.O(0)
    dshape, ushape = ctx.shape(data), ctx.shape(updates)
    picked = ctx.op("GatherElements", out, idx, axis=axis, shape=ushape)
    upd_hit = ctx.cast_like(ctx.op("Equal", updates, picked, shape=ushape), g)
    self_hit = ctx.cast_like(ctx.op("Equal", data, out, shape=dshape), g)
    # include_self=False is exported as a reset of the targets to the extreme value, then
    # this node; torch still counts the original data's ties in the split (its self then
    # gets none of the gradient: the reset's own rule sends it nothing there)
    original = _reset_from(ctx, data, idx, axis)
    counted = self_hit
    if original is not None:
        counted = ctx.cast_like(ctx.op("Equal", original, out, shape=dshape), g)
    ties = ctx.op("ScatterElements", counted, idx, upd_hit, axis=axis, reduction="add",
                  shape=dshape)  # fmt: skip
    share = ctx.op("Div", g, ties, shape=dshape)
    grads = {}
    if ctx.needs(0):
        grads[0] = ctx.op("Mul", share, self_hit, shape=dshape)
    if ctx.needs(2):
        read = ctx.op("GatherElements", share, idx, axis=axis, shape=ushape)
        grads[2] = ctx.op("Mul", read, upd_hit, shape=ushape)
    return grads


def _reset_from(ctx: GradContext, data: ir.Value, idx: ir.Value, axis: int) -> ir.Value | None:
    """The data before the exporter's reset of ``scatter_reduce(include_self=False)``
    (a max / min ScatterElements of +-float max at the same indices), else None."""
    node = data.producer()
    if node is None or node.op_type != "ScatterElements" or node.domain not in ("", "ai.onnx"):
        return None
    attrs = node.attributes
    red = attrs.get("reduction")
    if red is None or red.value not in ("max", "min") or node.inputs[1] is not idx:
        return None
    if int(attrs["axis"].value if "axis" in attrs else 0) % ctx.rank(data) != axis:
        return None
    fill = node.inputs[2].producer() if node.inputs[2] is not None else None
    if fill is None or fill.op_type != "ConstantOfShape" or "value" not in fill.attributes:
        return None
    value = abs(float(np.asarray(fill.attributes["value"].value.numpy()).reshape(-1)[0]))
    return node.inputs[0] if value >= float(np.finfo(np.float32).max) else None


@gradient("ScatterElements", nondiff_inputs=(1,))
def scatter_elements(ctx: GradContext):
    # none: written positions of data are overwritten (their gradient is 0); add: data
    # passes through. Every update (also one that lost to a repeated index, as in torch)
    # reads the gradient at the position it was written to.
    if str(ctx.attr("reduction", "none")) in ("max", "min"):
        return _scatter_extremum(ctx)
    red, axis, g, idx = _reduction(ctx), _axis(ctx), ctx.GO(0), ctx.I(1)
    out = {}
    if ctx.needs(0):
        out[0] = g
        if red == "none":
            zeros = ctx.zeros(ctx.shape(ctx.I(2)), g.dtype)
            out[0] = ctx.op("ScatterElements", g, idx, zeros, axis=axis, shape=ctx.shape(g))
    if ctx.needs(2):
        out[2] = ctx.op("GatherElements", g, idx, axis=axis, shape=ctx.shape(ctx.I(2)))
    return out


@gradient("ScatterND", nondiff_inputs=(1,))
def scatter_nd(ctx: GradContext):
    # As ScatterElements, with whole slices addressed by the last index axis.
    red, g, idx = _reduction(ctx), ctx.GO(0), ctx.I(1)
    out = {}
    if ctx.needs(0):
        out[0] = g
        if red == "none":
            zeros = ctx.zeros(ctx.shape(ctx.I(2)), g.dtype)
            out[0] = ctx.op("ScatterND", g, idx, zeros, shape=ctx.shape(g))
    if ctx.needs(2):
        out[2] = ctx.op("GatherND", g, idx, shape=ctx.shape(ctx.I(2)))
    return out


@gradient("TopK", nondiff_inputs=(1,), forward_outputs=2)
def topk(ctx: GradContext):
    # The values' gradient goes to the indices TopK returned (distinct, so no reduction).
    x, axis = ctx.I(0), _axis(ctx, -1)
    zeros = ctx.zeros(ctx.shape(x), ctx.GO(0).dtype)
    out = ctx.op("ScatterElements", zeros, ctx.O(1), ctx.GO(0), axis=axis, shape=ctx.shape(x))
    return {0: out}


# --- Einsum ------------------------------------------------------------------------------


def _einsum_terms(ctx: GradContext) -> tuple[list[list[str]], list[str], dict[str, int]]:
    """Operand and output subscripts with ``...`` spelled out as letters, and each letter's
    size. A size-1 dim broadcast against a larger one gets a letter of its own, so every
    letter has one size."""
    eq = str(ctx.attr("equation")).replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    shapes = [ctx.shape(ctx.I(i)) for i in range(len(terms))]
    free = iter(c for c in string.ascii_letters if c not in eq)
    widths = [len(s) - len(t.replace("...", "")) for t, s in zip(terms, shapes, strict=True)]
    ell = [next(free) for _ in range(max([0, *widths]))]

    def spell(term: str, width: int) -> list[str]:
        head, dots, tail = term.partition("...")
        return [*head, *(ell[len(ell) - width :] if dots else []), *tail]

    ops = [spell(t, w) for t, w in zip(terms, widths, strict=True)]
    size: dict[str, int] = {}
    for letters, shape in zip(ops, shapes, strict=True):
        for c, d in zip(letters, shape, strict=True):
            size[c] = max(size.get(c, 1), d)
    for letters, shape in zip(ops, shapes, strict=True):
        for j, (c, d) in enumerate(zip(letters, shape, strict=True)):
            if d == 1 and size[c] > 1:
                letters[j] = next(free)
                size[letters[j]] = 1
    if arrow:
        out = spell(rhs, len(ell))
    else:  # implicit output: the broadcast dims, then the letters used once, sorted
        once = [c for c in lhs if c.isalpha() and lhs.count(c) == 1]
        out = [*ell, *sorted(once)]
    return ops, out, size


@gradient("Einsum")
def einsum(ctx: GradContext):
    # Operand k's gradient is the einsum of the output gradient with the other operands,
    # out to k's distinct subscripts. Letters only k has (summed in k alone, or broadcast
    # size-1 dims) are absent from that product: added back by Unsqueeze + Expand. A letter
    # k repeats (a diagonal, "ii->i") gets the gradient on the diagonal only: times a mask.
    ops, out, size = _einsum_terms(ctx)
    grads = {}
    for k in sorted(ctx.needed):
        others = [j for j in range(len(ops)) if j != k]
        seen = set(out).union(*(ops[j] for j in others))
        keep = [c for c in dict.fromkeys(ops[k]) if c in seen]
        eq = ",".join("".join(t) for t in [out, *(ops[j] for j in others)])
        eq += "->" + "".join(keep)
        inputs = [ctx.GO(0), *(ctx.I(j) for j in others)]
        g = ctx.GO(0)
        if others or keep != out:  # else a one-operand einsum that only reshapes
            g = ctx.op("Einsum", *inputs, equation=eq, shape=[size[c] for c in keep])
        target = ctx.shape(ctx.I(k))
        first = {c: ops[k].index(c) for c in ops[k]}
        missing = [j for j, c in enumerate(ops[k]) if c not in seen or first[c] != j]
        if missing:
            full = [1 if j in missing else d for j, d in enumerate(target)]
            g = ctx.op("Unsqueeze", g, ctx.ints(missing), shape=full)
            if tuple(full) != tuple(target):
                g = ctx.op("Expand", g, ctx.ints(target), shape=target)
        if len(first) != len(ops[k]):
            g = ctx.op("Mul", g, _diagonal_mask(ctx, ops[k], target, g.dtype), shape=target)
        grads[k] = g
    return grads


def _diagonal_mask(
    ctx: GradContext, letters: list[str], shape: tuple[int, ...], dtype: ir.DataType
) -> ir.Value:
    """1 where every repeated subscript has equal indices, else 0 (size 1 on other axes)."""
    repeated = {c for c in letters if letters.count(c) > 1}
    axes = [j for j, c in enumerate(letters) if c in repeated]
    mask_shape = [d if j in axes else 1 for j, d in enumerate(shape)]
    grid = np.indices(mask_shape)
    mask = np.ones(mask_shape, dtype=bool)
    for c in repeated:
        at = [j for j, x in enumerate(letters) if x == c]
        for j in at[1:]:
            mask &= grid[j] == grid[at[0]]
    return ctx.const(mask.astype(np.float64).tolist(), dtype)


# --- data movement -----------------------------------------------------------------------


@gradient("Trilu", nondiff_inputs=(1,))
def trilu(ctx: GradContext):
    k = [ctx.I(1)] if ctx.has_input(1) else []
    upper = int(ctx.attr("upper", 1))
    return {0: ctx.op("Trilu", ctx.GO(0), *k, upper=upper, shape=ctx.shape(ctx.I(0)))}


def _undo_depth_to_space(ctx: GradContext, g: ir.Value, mode: str) -> ir.Value:
    """DepthToSpace is reshape -> transpose -> reshape: undo the three on ``g``."""
    n, c, h, w = ctx.shape(ctx.I(0))
    b = int(ctx.attr("blocksize"))
    if mode == "DCR":
        split, perm = [n, b, b, c // (b * b), h, w], [0, 3, 4, 1, 5, 2]
    else:
        split, perm = [n, c // (b * b), b, b, h, w], [0, 1, 4, 2, 5, 3]
    moved = [split[p] for p in perm]
    inv = [perm.index(i) for i in range(len(perm))]
    t = ctx.op("Transpose", ctx.reshape(g, moved), perm=inv, shape=split)
    return ctx.reshape(t, [n, c, h, w])


@gradient("DepthToSpace")
def depth_to_space(ctx: GradContext):
    mode = str(ctx.attr("mode", "DCR"))
    if mode not in ("DCR", "CRD"):
        raise NotImplementedError(f"DepthToSpace mode {mode!r}")
    return {0: _undo_depth_to_space(ctx, ctx.GO(0), mode)}


@gradient("SpaceToDepth")
def space_to_depth(ctx: GradContext):
    # SpaceToDepth is the exact inverse of DepthToSpace in DCR mode.
    b = int(ctx.attr("blocksize"))
    out = ctx.op("DepthToSpace", ctx.GO(0), blocksize=b, mode="DCR", shape=ctx.shape(ctx.I(0)))
    return {0: out}


@gradient("ReverseSequence", nondiff_inputs=(1,))
def reverse_sequence(ctx: GradContext):
    # Reversing the first len[b] steps is its own inverse; the steps after them stay put.
    out = ctx.op(
        "ReverseSequence", ctx.GO(0), ctx.I(1),
        batch_axis=int(ctx.attr("batch_axis", 1)), time_axis=int(ctx.attr("time_axis", 0)),
        shape=ctx.shape(ctx.I(0)),
    )  # fmt: skip
    return {0: out}
