"""Lazy modules (``nn.LazyLinear``, ``nn.LazyConv2d``): made with no shapes, which their
first call fills in. Before a dry run the trainer says so and how (it had failed with
torch's "uninitialized parameter" from deep inside); after one, with the optimizer made
before it (its parameters are filled in place), the model trains like eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortrain import ORTTrainer, TrainerOptions


class _Lazy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.LazyConv2d(4, 3)
        self.lin = nn.LazyLinear(3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.lin(torch.relu(self.conv(x)).flatten(1)), y)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [
        (torch.randn(4, 2, 6, 6, generator=g), torch.randint(0, 3, (4,), generator=g))
        for _ in range(n)
    ]


def test_a_lazy_module_before_its_first_call_is_refused_naming_it():
    torch.manual_seed(0)
    model = _Lazy()
    with pytest.raises(TypeError, match=r"conv, lin are lazy modules .* run the model once"):
        ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions())


def test_after_a_dry_run_a_lazy_model_trains_like_eager():
    batches = _batches(3)
    runs = []
    for use in (False, True):
        torch.manual_seed(0)
        model = _Lazy()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # made before the dry run
        with torch.no_grad():
            model(*batches[0])
        trainer = ORTTrainer(model, opt, TrainerOptions()) if use else None
        losses = []
        for x, y in batches:
            if trainer is not None:
                losses.append(float(trainer.train_step(x, y)))
                continue
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        if trainer is not None:
            trainer.sync_to_module()
            assert trainer.segments is None  # one graph
        runs.append((losses, model))
    (want, ref), (got, model) = runs
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)
