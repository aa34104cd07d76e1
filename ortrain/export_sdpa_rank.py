"""``F.scaled_dot_product_attention`` on query, key and value of any rank from 3 up.

torch takes ``[..., L, E]`` with any number of leading (batch) axes; the exporter's
function takes ``[B, H, L, E]`` only and refused the rest ("only 4D query, key, and value
are supported"): single-head attention written as ``[B, L, E]`` and windowed attention
written as ``[B, heads, windows, L, E]`` (Hiera, NesT) ran in eager. Here a 3-D call gets
a heads axis of 1 and a call of rank 5 or more has its leading axes (all but the one
before ``L``) flattened into one; the mask is broadcast to the leading axes first (it may
broadcast over any of them), the exporter's own 4-D function computes the attention, and
the result is reshaped back. Grouped-query attention (``enable_gqa``) pairs query heads
with key heads on the axis before ``L``, which a flattened batch would not keep: refused
at other ranks (the call runs in eager).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _sdpa(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Any:
    from onnxscript import opset18 as op
    from onnxscript.function_libs.torch_lib.ops.nn import aten_scaled_dot_product_attention

    def attend(q: Any, k: Any, v: Any, mask: Any) -> Any:
        return aten_scaled_dot_product_attention(
            q, k, v, mask, dropout_p, is_causal, scale, enable_gqa
        )

    def shaped(t: Any, like: Any, dims: list) -> Any:
        """``t`` with the shape and dtype the exporter's function reads (a traced op's
        output has none)."""
        from onnxscript import ir

        t.shape, t.dtype = ir.Shape(dims), like.dtype
        return t

    ranks = {len(query.shape), len(key.shape), len(value.shape)}
    if ranks == {4}:
        return attend(query, key, value, attn_mask)
    if len(ranks) != 1 or min(ranks) < 3:
        raise NotImplementedError(
            f"scaled_dot_product_attention with query, key and value of ranks "
            f"{len(query.shape)}, {len(key.shape)} and {len(value.shape)} (one rank, 3 or more)"
        )
    if enable_gqa:
        raise NotImplementedError(
            f"scaled_dot_product_attention(enable_gqa=True) on rank-{len(query.shape)} inputs"
        )
    rank = ranks.pop()
    if rank == 3:
        at = op.Constant(value_ints=[1])
        q, k, v = (
            shaped(op.Unsqueeze(t, at), t, [t.shape[0], 1, *t.shape[1:]])
            for t in (query, key, value)
        )
        if attn_mask is not None and len(attn_mask.shape) == 3:
            attn_mask = op.Unsqueeze(attn_mask, at)  # [B, L, S]: a heads axis of 1
        out = attend(q, k, v, attn_mask)
        return op.Squeeze(out, at)
    minus_one = op.Constant(value_ints=[-1])

    def four(t: Any) -> Any:
        dims = list(t.shape)
        lead = dims[: rank - 3]
        n = 1
        for d in lead:
            n = n * d if isinstance(d, int) and isinstance(n, int) else None
        flat = op.Reshape(t, op.Concat(minus_one, op.Shape(t, start=-3), axis=0))
        return shaped(flat, t, [n, *dims[rank - 3 :]])

    if attn_mask is not None:
        # [..., L, S] over the query's leading axes, then flattened like them
        lead_l = op.Shape(query, end=-1)
        s = op.Shape(key, start=-2, end=-1)
        full = op.Expand(attn_mask, op.Concat(lead_l, s, axis=0))
        attn_mask = four(shaped(full, attn_mask, [*query.shape[:-1], key.shape[-2]]))
    out = attend(four(query), four(key), four(value), attn_mask)
    shape = op.Concat(op.Shape(query, end=-1), op.Shape(value, start=-1), axis=0)
    return op.Reshape(out, shape)


def sdpa_translations() -> dict[Callable, Callable]:
    return {torch.ops.aten.scaled_dot_product_attention.default: _sdpa}
