"""A forward that changes a tensor it is given in place trains as eager does. Eager changes
the caller's tensor (a loop that passes the same tensor again sees it changed); a graph's
outputs do not, so the step was silently another one from the second step on (and
ortrain's own eager runs, the first step's check and the segments' recording, changed it
too). Such a forward is refused as one graph and runs in eager around compiled segments;
ortrain's own runs take copies of the batch. The same for a Python container it is given
(a memory bank appended to)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ortrain import ORTTrainer, TrainerOptions


class _Rescales(nn.Module):
    """Normalizes its input in place (``x -= mean`` style), then a small MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5).add_(1.0)
        return F.mse_loss(self.head(self.body(x)).squeeze(-1), y)


class _InPlaceBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.relu_(h))  # changes the caller's h


class _Residual(nn.Module):
    """A sub-module that changes its input in place, which the glue reads afterwards, in a
    model that runs as segments (Det has no gradient rule)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.block = _InPlaceBlock()
        self.score = nn.Linear(6, 4)
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        out = self.block(h) + h  # h as the block left it
        det = torch.linalg.det(self.score(x).reshape(-1, 2, 2))
        return F.mse_loss(self.head(out).squeeze(-1), y) + 0.01 * det.mean()


def _run(make, ortrain: bool) -> tuple[list[float], nn.Module, torch.Tensor, ORTTrainer | None]:
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = ORTTrainer(model, opt, TrainerOptions()) if ortrain else None
    x = torch.linspace(-1, 1, 24).reshape(4, 6).clone()  # passed again at every step
    y = torch.tensor([0.5, -0.2, 0.1, 0.3])
    losses = []
    for _ in range(4):
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
    return losses, model, x, trainer


def _assert_like_eager(make) -> ORTTrainer:
    want, ref, x_ref, _ = _run(make, ortrain=False)
    got, model, x, trainer = _run(make, ortrain=True)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    torch.testing.assert_close(x, x_ref, rtol=0, atol=0)  # changed as often as eager did
    for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)
    assert trainer is not None
    return trainer


def test_a_forward_that_changes_its_batch_input_in_place_trains_like_eager() -> None:
    trainer = _assert_like_eager(_Rescales)
    seg = trainer.segments
    assert seg is not None and "changes x in place" in seg.cause
    assert seg.model is not None and "body" in seg.model.compiled  # the rest still compiles


def test_a_segment_that_changes_its_input_in_place_runs_in_eager() -> None:
    trainer = _assert_like_eager(_Residual)
    seg = trainer.segments
    assert seg is not None and seg.model is not None
    assert "block" not in seg.model.compiled and "a" in seg.model.compiled


class _MemoryBank(nn.Module):
    """Appends each step's detached features to a list it is given, and reads the list."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, bank: list) -> torch.Tensor:
        h = self.lin(x)
        loss = h.pow(2).mean()
        if bank:
            loss = loss + (h @ torch.cat(bank).t()).pow(2).mean()
        bank.append(h.detach())
        return loss


def test_a_forward_that_appends_to_a_list_argument_trains_like_eager() -> None:
    """The list grew in eager and stayed empty under ortrain (the bank's term never came)."""
    g = torch.Generator().manual_seed(41)
    xs = [torch.randn(4, 6, generator=g) for _ in range(4)]
    runs = []
    for use in (False, True):
        torch.manual_seed(0)
        model, bank = _MemoryBank(), []
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = ORTTrainer(model, opt, TrainerOptions()) if use else None
        losses = []
        for x in xs:
            if trainer is not None:
                losses.append(float(trainer.train_step(x, bank)))
                continue
            loss = model(x, bank)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        if trainer is not None:
            trainer.sync_to_module()
            assert trainer.segments is not None
            assert "changes its argument bank in place" in trainer.segments.cause
        runs.append((losses, model, bank))
    (want, ref, bank_ref), (got, model, bank) = runs
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    assert len(bank) == len(bank_ref) == 4
    for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)
