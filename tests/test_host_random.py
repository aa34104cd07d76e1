"""A forward that draws from NumPy's global generator or Python's ``random`` (a mask, a
coin) cannot be one graph: the export would keep its first draw as a constant and train
another loss from the second step, with no error. The first-step check names the module
whose own code drew (``python_state.generator_draws``), which then runs in eager while
the rest compiles; it trains like eager with the same seeds.
"""

from __future__ import annotations

import copy
import random
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from ortrain import ORTTrainer, TrainerOptions
from ortrain.python_state import generator_draws


def _keep(kind: str, n: int) -> torch.Tensor:
    if kind == "numpy":
        return torch.from_numpy((np.random.rand(n) > 0.3).astype(np.float32))
    return torch.tensor([float(random.random() > 0.3) for _ in range(n)])


class _Noisy(nn.Module):
    """A linear layer whose input is masked by a host draw in its own forward."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(h * _keep(self.kind, h.shape[-1]))


class _Net(nn.Module):
    """``where``: the draw in the root's forward, or in a child's."""

    def __init__(self, kind: str, where: str):
        super().__init__()
        self.kind, self.where = kind, where
        self.a = nn.Linear(8, 8)
        self.mid = _Noisy(kind) if where == "child" else nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.where == "root":
            h = h * _keep(self.kind, h.shape[-1])
        return nn.functional.cross_entropy(self.b(torch.tanh(self.mid(h))), y)


def _seed() -> None:
    np.random.seed(0)
    random.seed(0)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["numpy", "python"])
@pytest.mark.parametrize("where", ["root", "child"])
def test_a_host_draw_runs_in_eager_and_trains_like_eager(kind, where):
    torch.manual_seed(0)
    model = _Net(kind, where)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(5)
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        trainer = ORTTrainer(model, opt, TrainerOptions(build_progress=False))
        _seed()
        losses = [trainer.train_step(x, y).item() for x, y in batches]
    _seed()
    opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    expected = []
    for x, y in batches:
        opt.zero_grad()
        loss = ref(x, y)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    label = "NumPy's global random generator" if kind == "numpy" else "Python's random module"
    said = " ".join(str(w.message) for w in caught)
    owner = "_Net" if where == "root" else "_Net.mid"
    assert f"{owner}: draws from {label}" in said, said
    # the owner runs in eager, what it calls still compiles
    compiled = set(trainer.segments.model.compiled)
    inner = {"a", "mid", "b"} if where == "root" else {"a", "mid.lin", "b"}
    assert compiled == inner, compiled


def test_generator_draws_names_the_modules_whose_own_code_drew():
    torch.manual_seed(0)
    model = _Net("numpy", "child")
    with generator_draws(model) as drawn:
        model(torch.randn(2, 8), torch.tensor([0, 1]))
    assert drawn == {"mid": ["NumPy's global random generator"]}
    model = _Net("python", "root")
    with generator_draws(model) as drawn:
        model(torch.randn(2, 8), torch.tensor([0, 1]))
    assert drawn == {"": ["Python's random module"]}
    with generator_draws(model) as drawn:
        model.a(torch.randn(2, 8))
    assert drawn == {}
