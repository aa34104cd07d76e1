"""``cumprod``, ``cummax`` and ``cummin`` compiled (``ortrain/export_scans.py``): values,
indices and gradients equal torch's, through zeros, ties and NaNs."""

from __future__ import annotations

import copy

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions
from ortrain.export_scans import _cum_extreme


class _Scans(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.offset = torch.nn.Parameter(torch.zeros(3, 11))

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
        v = x + self.offset
        prod = torch.cumprod(v, 1)
        top, low = torch.cummax(v, 1), torch.cummin(v, 0)
        loss = (prod * w).sum() + (top.values * w).sum() + (low.values * w.flip(1)).sum()
        return {
            "loss": loss,
            "prod": prod,
            "top": top.values,
            "top_at": top.indices,
            "low": low.values,
            "low_at": low.indices,
        }


def _x() -> torch.Tensor:
    # zeros inside a product, ties along both axes, negatives; 11: a ragged last step
    return torch.tensor(
        [
            [0.5, -1.2, 0.9, 0.0, 1.1, 1.1, -0.7, 1.3, 0.8, 1.3, -0.4],
            [1.0, 1.0, -0.5, 1.5, 0.2, 1.5, 0.9, 0.0, 1.5, -1.1, 0.3],
            [-0.3, 0.8, 0.8, -0.9, 1.2, 0.7, 1.2, 0.6, -0.2, 1.2, 1.0],
        ]
    )


def test_values_indices_and_gradients_equal_torchs() -> None:
    model = _Scans()
    ref = copy.deepcopy(model)
    options = TrainerOptions(fallback="off")  # compiled, or the test fails
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=1.0), options)
    w = torch.linspace(-1.0, 1.5, 33).reshape(3, 11)
    nan = _x().clone()
    nan[0, 2], nan[1, 4], nan[1, 6] = float("nan"), float("nan"), float("nan")
    for x in (_x(), nan):  # the evaluation graph: indices exactly, NaN where torch's
        outputs = trainer.eval_step(x=x, w=w)
        with torch.no_grad():
            for name, value in ref(x, w).items():
                if value.dtype == torch.int64:
                    assert torch.equal(outputs[name], value), name
                else:
                    torch.testing.assert_close(outputs[name], value, equal_nan=True, msg=name)
    want = ref(_x(), w)
    want["loss"].backward()
    got = trainer.train_step(x=_x(), w=w)
    assert trainer.segments is None
    torch.testing.assert_close(got, want["loss"].detach(), rtol=1e-6, atol=1e-6)
    trainer.sync_to_module()
    # the step is minus the gradient (lr 1): through the zeros and to the tie taken
    torch.testing.assert_close(-model.offset.detach(), ref.offset.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.float16])
@pytest.mark.parametrize("larger", [True, False])
def test_the_scan_takes_torchs_index_for_every_dtype(dtype: torch.dtype, larger: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 3, (5, 13), generator=g).to(dtype)  # ties everywhere
    want = torch.cummax(x, 1) if larger else torch.cummin(x, 1)
    values, indices = _cum_extreme(x, 1, larger)
    assert torch.equal(values, want.values) and torch.equal(indices, want.indices)
