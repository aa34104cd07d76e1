"""Fake quantization (quantization-aware training) decomposed as torch computes it.

``torch.fake_quantize_per_tensor_affine`` and ``fake_quantize_per_channel_affine`` (what
``torch.ao.quantization.FakeQuantize`` and QAT's fused modules call) have an ONNX
function in the exporter: ``QuantizeLinear`` then ``DequantizeLinear``. That function
takes only the 8-bit ranges ((0, 127), (0, 255), (-128, 127); 4-bit weights and other
ranges stop the export) and autodiff has no gradient through a quantize, where torch's
is the straight-through estimator: the incoming gradient where the rounded value falls
inside ``[quant_min, quant_max]``, 0 outside. So such a module ran in eager.

Here each is decomposed before the translation, as torch's CPU kernel computes it (in
float32: ``inv = 1 / scale``, ``q = round(x * inv) + zero_point`` with ties to even,
``out = (clamp(q, quant_min, quant_max) - zero_point) * scale``) and spelled
``sg(out) + (x - sg(x)) * inside`` with ``sg`` the export's stop-gradient
(``ortrain/stop_gradient.py``): the added term is exactly zero, and autodiff reads the
estimator off it. Scale and zero point get no gradient, as in torch. A per-channel zero
point that is not an integer (torch then rounds after adding it) is refused, so that
module runs in eager.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

aten = torch.ops.aten


def _straight_through(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    quant_min: int,
    quant_max: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the fake-quantized ``x``, where ``x`` is inside the range) with ``scale`` and
    ``zero_point`` broadcast against ``x``."""
    from ortrain.stop_gradient import stop_gradient

    xf = x.to(torch.float32)
    scale = scale.to(torch.float32)
    zero = zero_point.to(torch.float32)
    q = torch.round(xf * (1.0 / scale)) + zero
    out = ((torch.clamp(q, quant_min, quant_max) - zero) * scale).to(x.dtype)
    inside = (q >= quant_min) & (q <= quant_max)
    return stop_gradient(out) + (x - stop_gradient(x)) * inside.to(x.dtype), inside


def _per_tensor(
    x: torch.Tensor, scale: float, zero_point: int, quant_min: int, quant_max: int
) -> torch.Tensor:
    return _per_tensor_mask(x, scale, zero_point, quant_min, quant_max)[0]


def _per_tensor_mask(
    x: torch.Tensor, scale: float, zero_point: int, quant_min: int, quant_max: int
) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.full((), scale, dtype=torch.float32, device=x.device)
    z = torch.full((), zero_point, dtype=torch.int64, device=x.device)
    return _straight_through(x, s, z, quant_min, quant_max)


def _per_tensor_qparams(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, quant_min: int, quant_max: int
) -> torch.Tensor:
    return _straight_through(x, scale.reshape(()), zero_point.reshape(()), quant_min, quant_max)[0]


def _per_tensor_qparams_mask(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    fake_quant_enabled: torch.Tensor,
    quant_min: int,
    quant_max: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    # torch's kernel reads ``fake_quant_enabled`` on the host; FakeQuantize's own forward
    # already branched on it before this call, so here it is on
    return _straight_through(x, scale.reshape(()), zero_point.reshape(()), quant_min, quant_max)


def _per_channel(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    axis: int,
    quant_min: int,
    quant_max: int,
) -> torch.Tensor:
    return _per_channel_mask(x, scale, zero_point, axis, quant_min, quant_max)[0]


def _per_channel_mask(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    axis: int,
    quant_min: int,
    quant_max: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    if zero_point.is_floating_point():
        raise NotImplementedError(
            "fake_quantize_per_channel_affine with a floating zero point (torch rounds "
            "after adding it) is not decomposed for the export"
        )
    shape = [1] * x.dim()
    shape[axis % x.dim()] = -1
    return _straight_through(
        x, scale.reshape(shape), zero_point.reshape(shape), quant_min, quant_max
    )


def fake_quantize_decompositions() -> dict[torch._ops.OpOverload, Callable]:
    """Decompositions that replace the exporter's own function (module docstring)."""
    return {
        aten.fake_quantize_per_tensor_affine.default: _per_tensor,
        aten.fake_quantize_per_tensor_affine.tensor_qparams: _per_tensor_qparams,
        aten.fake_quantize_per_tensor_affine_cachemask.default: _per_tensor_mask,
        aten._fake_quantize_per_tensor_affine_cachemask_tensor_qparams.default: (
            _per_tensor_qparams_mask
        ),
        aten.fake_quantize_per_channel_affine.default: _per_channel,
        aten.fake_quantize_per_channel_affine_cachemask.default: _per_channel_mask,
    }
