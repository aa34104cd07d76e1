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
    """``fn`` at the points, each weighted; the trained offset starts at 0, so after one
    SGD step of rate 1 it holds minus the gradient, without the cancellation a step of
    the points themselves would have."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn
        self.register_buffer("points", torch.tensor(POINTS))
        self.offset = torch.nn.Parameter(torch.zeros(len(POINTS)))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return (self.fn(self.points + self.offset) * w).sum()


FUNCTIONS = {
    "lgamma": torch.lgamma,
    "digamma": torch.digamma,
    "trigamma": lambda p: torch.polygamma(1, p),
    "gammaln": torch.special.gammaln,
    "mvlgamma": lambda p: torch.mvlgamma(p.abs() + 2.0, 3),
}


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_values_and_gradients_equal_torchs(name: str) -> None:
    fn = FUNCTIONS[name]
    model = _Elementwise(fn)
    ref = copy.deepcopy(model)
    options = TrainerOptions(fallback="off")  # compiled, or the test fails
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=1.0), options)
    opt = torch.optim.SGD(ref.parameters(), lr=1.0)
    w = torch.linspace(0.5, 1.5, len(POINTS))
    want = ref(w)
    want.backward()
    grad = ref.offset.grad.clone()
    opt.step()
    got = trainer.train_step(w=w)
    torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=0)
    assert trainer.segments is None
    trainer.sync_to_module()
    # the step is minus the gradient (lr 1): compared as gradients, to float32's rounding
    torch.testing.assert_close(-model.offset.detach(), grad, rtol=2e-6, atol=1e-6)
    with torch.no_grad():  # the values one by one, through an evaluation graph
        values = trainer.eval_step(w=torch.eye(len(POINTS))[3])["loss"]
    want_values = fn(ref.points + ref.offset.detach())[3]
    torch.testing.assert_close(values, want_values, rtol=1e-6, atol=1e-7)


def test_a_higher_polygamma_is_refused_by_the_export_and_runs_in_eager() -> None:
    model = _Elementwise(lambda p: torch.polygamma(2, p))
    off = ORTTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions(fallback="off")
    )
    with pytest.raises(ExportError, match="polygamma of order 2"):
        off.train_step(w=torch.ones(len(POINTS)))
    model = _Elementwise(lambda p: torch.polygamma(2, p))
    ref = copy.deepcopy(model)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.warns(UserWarning, match="polygamma of order 2"):
        got = trainer.train_step(w=torch.ones(len(POINTS)))
    torch.testing.assert_close(got, ref(torch.ones(len(POINTS))).detach(), rtol=1e-6, atol=0)
