"""Parameters other than float32 (a model in float64, bfloat16 weights).

ortrain's graphs, their gradient rules and its update engines are built for float32
parameters. A module holding others is not compiled: with ``fallback="auto"`` the model
trains as segments (``segmented_program.py``), such modules in eager PyTorch and the
update the optimizer's own ``step()``, so it trains as eager would; with
``fallback="off"``, or where ortrain's own machinery would have to hold those parameters
(mixed precision, loss scaling, torch.distributed) it is refused, naming the parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ortrain.core.errors import ParameterDtypeError
from ortrain.options import TrainerOptions


def other_dtype(module: torch.nn.Module) -> str:
    """Why ``module`` is not compiled for its parameters' dtype ("": all float32)."""
    for name, p in module.named_parameters():
        if p.dtype != torch.float32:
            return f"parameter {name} is {p.dtype} (ortrain compiles float32 parameters)"
    return ""


def eager_for_dtype(module: torch.nn.Module, options: TrainerOptions) -> str:
    """Why ``module`` trains in eager for its parameters' dtype (""), or raises where it
    may not."""
    cause = other_dtype(module)
    if not cause:
        return ""
    if options.fallback == "off":
        raise ParameterDtypeError(
            f"{type(module).__name__}: {cause}; fallback='off' trains compiled graphs only "
            "(fallback='auto' trains such a model in eager PyTorch), or convert the model "
            "with model.float()"
        )
    for what, given in (
        ("mixed_precision", options.mixed_precision),
        ("loss_scale", options.resolved_loss_scale),
    ):
        if given is not None:
            raise ParameterDtypeError(
                f"{type(module).__name__}: {cause}; {what}={given!r} runs in ortrain's "
                "compiled float32 graphs: train float32 parameters (model.float()) with "
                f"{what}, or these parameters without it"
            )
    # data parallel and ZeRO hold gradients (and parameters) in float32 flat buffers;
    # every rank holds the same model, so all refuse alike before any collective
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size(options.process_group) > 1:
            raise ParameterDtypeError(
                f"{type(module).__name__}: {cause}; data parallel and ZeRO reduce float32 "
                "gradients: convert the model with model.float() to train it distributed"
            )
    return cause
