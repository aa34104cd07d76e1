"""``log1p``, ``expm1``, ``logaddexp`` and ``logaddexp2`` as precise as torch's, with its
gradients (``ortrain/export_precise.py``): the exporter's forms lost the digits these
functions exist for (``log1p(1e-7)`` was 1.19e-7) or overflowed (``logaddexp(0, 100)`` was
inf)."""

from __future__ import annotations

import math

import torch

from ortrain import ORTTrainer, TrainerOptions

# tiny to large magnitudes of both signs, the points where the plain forms fail, and
# the edges (zero, -1 for log1p, overflow of exp, infinities, NaN)
_X = torch.cat([
    torch.logspace(-10, 1.5, 120), -torch.logspace(-10, -0.0001, 90),
    torch.tensor([0.0, -0.0, 1e-7, -1e-7, 0.5, -0.5, -0.999, -1.0, 88.0, 100.0, -100.0]),
    torch.tensor([math.inf, -math.inf, math.nan]),
])  # fmt: skip
_Y = torch.cat([_X[:-3].flip(0) * 3 + 1, torch.tensor([math.inf, 2.0, math.nan])])


class _Precise(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        # the loss over the finite values whose gradient is finite too (chosen before the
        # scale multiplies them: 0 * inf would make its gradient NaN)
        tame = torch.isfinite(x) & torch.isfinite(y) & (x > -0.99) & (x < 50)
        xs, ys = torch.where(tame, x, 0.5) * self.scale, torch.where(tame, y, 0.5)
        x = x * self.scale
        outs = (
            torch.log1p(x),
            torch.expm1(x),
            torch.logaddexp(10 * x, y),
            torch.logaddexp2(10 * x, y),
        )
        loss = (
            torch.log1p(xs) + torch.expm1(xs) + torch.logaddexp(10 * xs, ys)
            + torch.logaddexp2(10 * xs, ys)
        ).sum()  # fmt: skip
        return loss, *outs


def test_precise_forms_match_torch_in_value_and_gradient() -> None:
    """Every value within 3e-7 relative of torch's (NaN and infinities where torch's
    are), the points the exporter's forms got wrong among them, and one SGD step's
    update of the scale as eager's."""
    model, ref = _Precise(), _Precise()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=1e-6),
                         TrainerOptions(fallback="off", graph_cache=False))  # fmt: skip
    got = trainer.eval_step(_X, _Y)
    want = ref(_X, _Y)
    for k, name in enumerate(("log1p", "expm1", "logaddexp", "logaddexp2"), start=1):
        g, w = got[f"output_{k}"], want[k]
        assert torch.equal(g.isnan(), w.isnan()) and torch.equal(g.isinf(), w.isinf()), name
        torch.testing.assert_close(g, w, rtol=3e-7, atol=1e-38, equal_nan=True, msg=name)
    out = got
    tiny = (_X == 1e-7).nonzero()[0, 0]
    assert abs(out["output_1"][tiny].item() / 1e-7 - 1) < 1e-6  # Log(1 + x) gave 1.19e-7
    assert abs(out["output_2"][tiny].item() / 1e-7 - 1) < 1e-6
    big = (_X == 100.0).nonzero()[0, 0]
    assert out["output_3"][big].item() == want[3][big].item() == 1000.0  # not inf
    want[0].backward()
    loss = trainer.train_step(_X, _Y)
    torch.testing.assert_close(loss, want[0].detach(), rtol=1e-6, atol=0)
    trainer.sync_to_module()
    torch.testing.assert_close(model.scale, 1.0 - 1e-6 * ref.scale.grad, rtol=1e-6, atol=0)
    graph = trainer.train_graphs[0].graph
    assert not [n for n in graph if n.op_type == "StopGradient"]  # gone after autodiff
