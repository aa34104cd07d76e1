"""A loop carried over from eager that still clips and steps the optimizer after
``train_step`` (``ortrain/runtime/outside_steps.py``): the step finds no gradients and the
clipping did nothing, which the first such call says; ortrain's own steps of the optimizer
and a user's eager step after ``sync_to_module()`` say nothing."""

from __future__ import annotations

import warnings

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _loss(out: torch.Tensor, batch: dict) -> torch.Tensor:
    return (out - batch["y"]).pow(2).mean()


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)


def _told(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "outside train_step" in str(w.message)]


def test_a_step_after_train_step_that_changes_nothing_is_told_once() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = ORTTrainer(model, opt, TrainerOptions(build_progress=False), loss_fn=_loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            x, y = _batch(i)
            trainer.train_step(x, y=y)
            before = [p.detach().clone() for p in model.parameters()]
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
            opt.zero_grad()
            assert float(norm) == 0.0  # no gradient there to clip
            for p, q in zip(model.parameters(), before, strict=True):
                assert torch.equal(p, q)
    told = _told(caught)
    assert len(told) == 1 and "max_grad_norm" in told[0], told


@pytest.mark.parametrize("make", [torch.optim.RMSprop, torch.optim.Adagrad])
def test_ortrain_s_own_steps_of_an_eager_optimizer_say_nothing(make) -> None:
    model = _model()
    opt = make(model.parameters(), lr=1e-2)  # its own step() runs inside train_step
    trainer = ORTTrainer(model, opt, TrainerOptions(build_progress=False), loss_fn=_loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            x, y = _batch(i)
            trainer.train_step(x, y=y)
    assert trainer.step == 3
    assert _told(caught) == []


def test_an_eager_step_of_the_user_s_after_sync_to_module_says_nothing() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = ORTTrainer(model, opt, TrainerOptions(build_progress=False), loss_fn=_loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, y = _batch(0)
        trainer.train_step(x, y=y)
        trainer.sync_to_module()
        _loss(model(x), {"y": y}).backward()
        opt.step()  # gradients there: the user's own step
        opt.zero_grad()
        trainer.train_step(x, y=y)
    assert _told(caught) == []
