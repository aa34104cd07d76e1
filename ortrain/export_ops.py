"""ONNX translations for custom torch ops that models bring and the exporter lacks.

``torch.onnx.export`` translates a custom op (``torch.library.custom_op``) only through a
``custom_translation_table`` entry; without one the export stops with "No ONNX function
found". The translations here are written with plain ONNX ops that ortrain's autodiff
differentiates and ONNX Runtime's CPU EP runs.

1. ``transformers::grouped_mm_fallback(input, weight, offs)``: the grouped matmul of
   transformers' default ``grouped_mm`` experts implementation (Mixtral, Qwen2-MoE, OLMoE,
   ...) when it is traced with float32 weights. Rows of ``input`` are sorted by expert;
   ``offs[e]`` is the end row of expert ``e``'s group; rows past ``offs[-1]`` (expert
   parallel sentinels) are zero.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _grouped_mm(input: Any, weight: Any, offs: Any) -> Any:
    """Row r: ``input[r] @ weight[g(r)]`` with g(r) = #{e : offs[e] <= r}, else 0.

    Shapes are static (S rows, E experts), but the group sizes are data: every row is
    multiplied by every expert's weight, ``[E, S, out]``, and a Where keeps the row's own
    expert. Picking with Where, not a one-hot product, keeps the result bitwise equal to
    the row's own product (0 x inf elsewhere cannot leak in); the weight gradient stays a
    MatMul (a per-row Gather of the weights would scatter-add an ``[S, in, out]`` tensor).
    """
    from onnxscript import opset18 as op

    zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
    rows = op.Range(zero, op.Gather(op.Shape(input), zero, axis=0), one)  # [S]
    ends = op.Cast(offs, to=7)  # int64, [E]
    # [S, E]: expert e's group ends at or before row r; their count is r's group.
    ended = op.LessOrEqual(op.Unsqueeze(ends, zero), op.Unsqueeze(rows, one))
    group = op.ReduceSum(op.Cast(ended, to=7), op.Constant(value_ints=[1]), keepdims=0)  # [S]
    experts = op.Range(zero, op.Gather(op.Shape(weight), zero, axis=0), one)  # [E]
    # [E, S, 1]: row r is in expert e's group (a sentinel row past offs[-1] is in none).
    mine = op.Equal(op.Unsqueeze(experts, one), op.Unsqueeze(group, zero))
    mine = op.Unsqueeze(mine, op.Constant(value_ints=[2]))
    every = op.MatMul(op.Unsqueeze(input, zero), weight)  # [E, S, out]
    picked = op.Where(mine, every, op.CastLike(op.Constant(value_float=0.0), every))
    return op.ReduceSum(picked, op.Constant(value_ints=[0]), keepdims=0)


def custom_translations() -> dict[Callable, Callable]:
    """The translation table for the custom ops registered in this process."""
    table: dict[Callable, Callable] = {}
    transformers_ops = getattr(torch.ops, "transformers", None)
    grouped = getattr(transformers_ops, "grouped_mm_fallback", None) if transformers_ops else None
    if grouped is not None:
        table[grouped.default] = _grouped_mm
    return table


def eager_experts(module: torch.nn.Module) -> list[str]:
    """The submodules that run transformers' eager experts loop: the expert modules its
    ``use_experts_implementation`` decorator made (their ``__init__`` sets
    ``_is_expert_parallel``; their ``forward`` dispatches on their config's
    ``_experts_implementation``) whose implementation is "eager". The config attribute alone
    says nothing: transformers gives every model one ("eager" by default), experts or not."""
    found = []
    for name, m in module.named_modules():
        config = getattr(m, "config", None)
        if hasattr(m, "_is_expert_parallel") and (
            getattr(config, "_experts_implementation", None) == "eager"
        ):
            found.append(name)
    return found


def parameter_writers(module: torch.nn.Module) -> list[str]:
    """Sub-modules whose forward writes a parameter in place: ``Embedding`` and
    ``EmbeddingBag`` with ``max_norm`` renormalise the rows a batch reads (under no_grad),
    which the exporter stops at with an internal assertion that names nothing."""
    found = []
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.Embedding | torch.nn.EmbeddingBag) and m.max_norm is not None:
            kind = type(m).__name__
            where = f"{kind} '{name}'" if name else f"'{kind}'"
            found.append(f"{where} (max_norm={m.max_norm:g})")
    return found


def known_cause(module: torch.nn.Module) -> str:
    """What the module does that no graph can, where the exporter's own error hides it;
    "" if nothing known."""
    writers = parameter_writers(module)
    if not writers:
        return ""
    some = ", ".join(writers[:3]) + (f" and {len(writers) - 3} more" if len(writers) > 3 else "")
    return (
        f"{some} renormalises the rows a batch reads in place, a write to its weight that "
        "a graph cannot make"
    )


def export_hint(module: torch.nn.Module) -> str:
    """Advice to append to a failed export's error, for causes known from the model."""
    experts = eager_experts(module)
    if experts:
        # The eager experts loop runs only the experts a batch hits: data-dependent control
        # flow that torch.export cannot trace.
        return (
            f"; the model's experts loop ({experts[0]}: experts_implementation='eager') "
            "depends on the routing: call model.set_experts_implementation('grouped_mm') "
            "(transformers' default) or 'batched_mm', the same experts"
        )
    return ""
