"""``lgamma``, ``digamma`` and ``polygamma(1, x)`` compiled (``ortrain/export_gamma.py``):
values and gradients equal torch's across the real line, poles aside."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.errors import ExportError

# both sides of the reflection (0.5), the shift's edge (8), near the zeros of lgamma (1, 2)
POINTS = [-3.7, -2.5, -1.3, -0.6, -0.2, 0.1, 0.3, 0.5, 0.9, 1.0, 1.001, 1.5, 2.0, 2.5]
POINTS += [3.3, 7.9, 8.1, 15.0, 40.0, 123.4, 1000.5, 1.0e5]


class _Elementwise(torch.nn.Module):
    """Each function at the points, weighted, through an offset of its own that starts at
    0: after one SGD step of rate 1 the offset holds minus that function's gradient,
    without the cancellation a step of the points themselves would have."""

    def __init__(self, fns: dict[str, Callable[[torch.Tensor], torch.Tensor]]) -> None:
        super().__init__()
        self.fns = fns
        self.register_buffer("points", torch.tensor(POINTS))
        self.offsets = torch.nn.ParameterDict(
            {name: torch.nn.Parameter(torch.zeros(len(POINTS))) for name in fns}
        )

    def values(self) -> dict[str, torch.Tensor]:
        return {name: fn(self.points + self.offsets[name]) for name, fn in self.fns.items()}

    def forward(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        values = self.values()
        loss = sum((v * w).sum() for v in values.values())
        return {"loss": loss, **values}


FUNCTIONS = {
    "lgamma": torch.lgamma,
    "digamma": torch.digamma,
    "trigamma": lambda p: torch.polygamma(1, p),
    "gammaln": torch.special.gammaln,
    "mvlgamma": lambda p: torch.mvlgamma(p.abs() + 2.0, 3),
}


def test_values_and_gradients_equal_torchs() -> None:
    model = _Elementwise(FUNCTIONS)
    ref = copy.deepcopy(model)
    options = TrainerOptions(fallback="off")  # compiled, or the test fails
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=1.0), options)
    w = torch.linspace(0.5, 1.5, len(POINTS))
    # the values at the points, through an evaluation graph; torch's float32 reflection
    # (sin(pi x) in float32) is itself 1.3e-6 from float64's trigamma at -3.7
    outputs = trainer.eval_step(w=w)
    with torch.no_grad():
        for name, value in ref.values().items():
            torch.testing.assert_close(outputs[name], value, rtol=2e-6, atol=1e-7, msg=name)
    want = ref(w)
    want["loss"].backward()
    got = trainer.train_step(w=w)
    torch.testing.assert_close(got, want["loss"].detach(), rtol=1e-6, atol=0)
    assert trainer.segments is None
    trainer.sync_to_module()
    for name in FUNCTIONS:
        # the step is minus the gradient (lr 1): compared as gradients, to float32's rounding
        grad = ref.offsets[name].grad
        torch.testing.assert_close(-model.offsets[name].detach(), grad, rtol=2e-6, atol=1e-6)


def test_a_higher_polygamma_is_refused_by_the_export_and_runs_in_eager() -> None:
    model = _Elementwise({"tetragamma": lambda p: torch.polygamma(2, p)})
    off = ORTTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions(fallback="off")
    )
    with pytest.raises(ExportError, match="polygamma of order 2"):
        off.train_step(w=torch.ones(len(POINTS)))
    model = _Elementwise({"tetragamma": lambda p: torch.polygamma(2, p)})
    ref = copy.deepcopy(model)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.warns(UserWarning, match="polygamma of order 2"):
        got = trainer.train_step(w=torch.ones(len(POINTS)))
    want = ref(torch.ones(len(POINTS)))["loss"].detach()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
