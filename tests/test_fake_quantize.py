"""Fake quantization compiled with torch's values and its straight-through gradient
(``ortrain/export_fake_quantize.py``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from ortrain import ORTTrainer, TrainerOptions
from ortrain.export_fake_quantize import fake_quantize_decompositions

aten = torch.ops.aten


class _Quantized(torch.nn.Module):
    """Activations fake-quantized per tensor (a float scale, and buffers as
    ``FakeQuantize`` keeps them), weights per output channel to 4 bits."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)
        self.register_buffer("scale", torch.tensor([0.05]))
        self.register_buffer("zero_point", torch.tensor([3], dtype=torch.int32))
        self.register_buffer("w_scale", torch.linspace(0.01, 0.04, 4))
        self.register_buffer("w_zero", torch.tensor([0, 1, -1, 0], dtype=torch.int32))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # a narrow range: many activations fall outside and get no gradient
        h = torch.fake_quantize_per_tensor_affine(self.a(x), 0.1, 0, -8, 7)
        h = torch.fake_quantize_per_tensor_affine(
            torch.relu(h), self.scale, self.zero_point, 0, 255
        )
        w = torch.fake_quantize_per_channel_affine(
            self.b.weight, self.w_scale, self.w_zero, 0, -8, 7
        )
        return F.cross_entropy(F.linear(h, w, self.b.bias), y)


def test_fake_quantized_model_compiles_whole_and_trains_like_eager() -> None:
    model = _Quantized()
    ref = copy.deepcopy(model)
    options = TrainerOptions(fallback="off")  # compiled, or the test fails
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for i in range(4):
        x, y = torch.randn(16, 8, generator=g) * 2, torch.randint(0, 4, (16,), generator=g)
        want = ref(x, y)
        want.backward()
        opt.step()
        opt.zero_grad()
        got = trainer.train_step(x=x, y=y)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0, msg=f"step {i}")
    assert trainer.segments is None
    (graph,) = trainer.train_graphs
    ops = {n.op_type for n in graph.graph}
    assert not {"QuantizeLinear", "DequantizeLinear"} & ops and "Round" in ops
    trainer.sync_to_module()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)


def _values() -> torch.Tensor:
    # ties at x * 2 = k + 0.5 (ties to even), both range ends, and far outside
    ties = torch.tensor([0.25, 0.75, 1.25, -0.25, -0.75, -1.25, 3.5, 3.75, -4.0, -4.25, 9.0, -9.0])
    drawn = torch.randn(200, generator=torch.Generator().manual_seed(2)) * 3
    return torch.cat([ties, drawn, drawn * 10])


@pytest.mark.parametrize(
    ("op", "args"),
    [
        (aten.fake_quantize_per_tensor_affine.default, (0.5, 1, -8, 7)),
        (aten.fake_quantize_per_tensor_affine.default, (0.1, 0, -128, 127)),
        (aten.fake_quantize_per_tensor_affine.default, (0.3, 200, 0, 255)),
        (
            aten.fake_quantize_per_tensor_affine.tensor_qparams,
            (torch.tensor(0.5), torch.tensor(-2, dtype=torch.int32), -8, 7),
        ),
    ],
)
def test_per_tensor_values_and_inside_mask_equal_torchs(op, args) -> None:
    x = _values()
    ours = fake_quantize_decompositions()[op]
    torch.testing.assert_close(ours(x, *args), op(x, *args), rtol=0, atol=0)
    # torch's gradient (the straight-through estimator) against the mask ours reads it off
    leaf = x.clone().requires_grad_(True)
    op(leaf, *args).sum().backward()
    masked = {
        aten.fake_quantize_per_tensor_affine.default: (
            aten.fake_quantize_per_tensor_affine_cachemask.default
        ),
        aten.fake_quantize_per_tensor_affine.tensor_qparams: (
            aten._fake_quantize_per_tensor_affine_cachemask_tensor_qparams.default
        ),
    }[op]
    if op is aten.fake_quantize_per_tensor_affine.tensor_qparams:
        s, z, lo, hi = args
        _, inside = fake_quantize_decompositions()[masked](x, s, z, torch.tensor([1]), lo, hi)
    else:
        _, inside = fake_quantize_decompositions()[masked](x, *args)
    torch.testing.assert_close(leaf.grad, inside.to(x.dtype), rtol=0, atol=0)
    assert 0 < int(inside.sum()) < x.numel()  # both sides of the range are exercised


def test_per_channel_values_equal_torchs_and_a_float_zero_point_is_refused() -> None:
    w = _values()[:200].reshape(8, 25)
    scale = torch.linspace(0.05, 0.5, 8)
    zero = torch.arange(-4, 4, dtype=torch.int32)
    op = aten.fake_quantize_per_channel_affine.default
    ours = fake_quantize_decompositions()[op]
    for axis, (s, z) in ((0, (scale, zero)), (1, (scale.repeat(4)[:25], zero.repeat(4)[:25]))):
        torch.testing.assert_close(
            ours(w, s, z, axis, -8, 7), op(w, s, z, axis, -8, 7), rtol=0, atol=0
        )
    with pytest.raises(NotImplementedError, match="floating zero point"):
        ours(w, scale, zero.float(), 0, -8, 7)
