"""Layers frozen or unfrozen mid-training (``requires_grad`` changed between steps), as in
eager: the trainer lays its graphs and optimizer state out anew for the parameters that
require grad now; a frozen parameter keeps its optimizer state in ``optimizer.state`` for
when it thaws, whose per-parameter step count then differs from the others' (the update
moves to the optimizer's own step). The same through the path the error names elsewhere
(``sync_to_module()`` and a new ORTTrainer over the same optimizer)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.errors import TrainableChangedError

pytestmark = pytest.mark.shared_graphs  # many trainers of the same few models


class _Three(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 16)
        self.c = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.c(torch.tanh(self.b(torch.tanh(self.a(x))))), y)


def _plan(model: _Three, i: int, alone: bool = False) -> None:
    if i == 2:
        model.a.requires_grad_(False)  # the first layer frozen
    if i == 4:
        model.a.requires_grad_(True)  # thawed, and the head frozen
        model.c.requires_grad_(False)
        if alone:  # the thawed layer alone trains: its steps are even, the others' not
            model.b.requires_grad_(False)


def _data(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)
    ]


def _eager(model: _Three, optimizer: torch.optim.Optimizer, data, alone=False) -> list[float]:
    losses = []
    for i, (x, y) in enumerate(data):
        _plan(model, i, alone)
        optimizer.zero_grad()
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _same_as_eager(model, ref, opt, ref_opt, losses, ref_losses) -> None:
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
    # the optimizer's state as eager's: the frozen-then-thawed layer's own step count
    ours, theirs = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert sorted(ours) == sorted(theirs)
    for k in theirs:
        assert float(ours[k]["step"]) == float(theirs[k]["step"]), k
        torch.testing.assert_close(ours[k]["exp_avg"], theirs[k]["exp_avg"], rtol=1e-5, atol=1e-7)


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("alone", [False, True], ids=["with-others", "alone"])
def test_freezing_and_thawing_between_steps_trains_like_eager(alone):
    torch.manual_seed(0)
    model = _Three()
    ref = copy.deepcopy(model)
    ref_opt = _adamw(ref)
    data = _data()
    ref_losses = _eager(ref, ref_opt, data, alone)
    opt = _adamw(model)
    trainer = ORTTrainer(model, opt, TrainerOptions(), loss_fn=lambda out, batch: out)
    losses = []
    for i, (x, y) in enumerate(data):
        _plan(model, i, alone)
        if i in (2, 4):
            with pytest.warns(UserWarning, match="laid out anew"):
                losses.append(float(trainer.train_step(x=x, y=y)))
        else:
            losses.append(float(trainer.train_step(x=x, y=y)))
    _same_as_eager(model, ref, opt, ref_opt, losses, ref_losses)
    # a graph per trainable set, the builds before the changes still counted
    assert trainer.build_count == 3
    # the optimizer steps of the parameters it trains (the thawed layer's, alone)
    assert trainer.step == (4 if alone else 6)


def test_a_new_trainer_over_the_same_optimizer_goes_on_from_its_state():
    """The path TrainableChangedError names where the trainer cannot lay out anew: the
    first trainer's hooks on the optimizer no longer take the state the second starts
    from (it started from no moments, silently, before)."""
    torch.manual_seed(0)
    model = _Three()
    ref = copy.deepcopy(model)
    ref_opt = _adamw(ref)
    data = _data()
    ref_losses = _eager(ref, ref_opt, data)
    opt = _adamw(model)
    trainer = ORTTrainer(model, opt, TrainerOptions(), loss_fn=lambda out, batch: out)
    losses = []
    for i, (x, y) in enumerate(data):
        if i in (2, 4):
            trainer.sync_to_module()
            _plan(model, i)
            trainer = ORTTrainer(model, opt, TrainerOptions(), loss_fn=lambda out, batch: out)
        losses.append(float(trainer.train_step(x=x, y=y)))
    _same_as_eager(model, ref, opt, ref_opt, losses, ref_losses)


def test_a_change_mid_window_is_refused_and_nothing_runs():
    torch.manual_seed(0)
    model = _Three()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options = TrainerOptions(grad_accumulation_steps=2)
    trainer = ORTTrainer(model, opt, options, loss_fn=lambda out, batch: out)
    (x, y), (x2, y2) = _data(2)
    trainer.train_step(x=x, y=y)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.a.requires_grad_(False)
    with pytest.raises(TrainableChangedError, match="window's start"):
        trainer.train_step(x=x2, y=y2)
    assert trainer.micro_step == 1
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n


def test_a_transformers_model_with_its_first_block_frozen_then_thawed():
    """GPT-2 (tied embedding and head) with its first block frozen for two steps, SGD with
    momentum: losses and parameters as eager's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    model = GPT2LMHeadModel(cfg)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 64, (2, 12), generator=g) for _ in range(5)]

    def plan(m: torch.nn.Module, i: int) -> None:
        if i in (1, 3):
            m.transformer.h[0].requires_grad_(i == 3)

    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    ref_losses = []
    for i, ids in enumerate(batches):
        plan(ref, i)
        ref_opt.zero_grad()
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = ORTTrainer(model, opt, TrainerOptions())
    losses = []
    with pytest.warns(UserWarning, match="laid out anew"):
        for i, ids in enumerate(batches):
            plan(model, i)
            losses.append(float(trainer.train_step(input_ids=ids, labels=ids)))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-5, msg=name)
    assert trainer.step == 5
    # the frozen block's momentum kept while frozen, in torch's format as eager's
    ours, theirs = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert sorted(ours) == sorted(theirs)
    for k in theirs:
        torch.testing.assert_close(
            ours[k]["momentum_buffer"], theirs[k]["momentum_buffer"], rtol=1e-4, atol=1e-6
        )


def test_a_checkpoint_taken_after_a_thaw_resumes_like_eager(tmp_path):
    """After a thaw the parameters' step counts differ and the update is the optimizer's
    own: its checkpoint loads into a new trainer over a fresh model and optimizer (whose
    update starts compiled) and goes on there as eager goes on (it was refused as
    "eager optimizer state" before)."""
    torch.manual_seed(0)
    model = _Three()
    ref = copy.deepcopy(model)
    ref_opt = _adamw(ref)
    data = _data(7)
    ref_losses = _eager(ref, ref_opt, data)
    opt = _adamw(model)
    trainer = ORTTrainer(model, opt, TrainerOptions(), loss_fn=lambda out, batch: out)
    losses = []
    with pytest.warns(UserWarning, match="laid out anew"):
        for i, (x, y) in enumerate(data):
            _plan(model, i)
            if i == 5:
                trainer.save_checkpoint(tmp_path / "ckpt.pt")
                model, opt = _Three(), None
                _plan(model, 2)
                _plan(model, 4)  # the frozen set of the run it resumes
                opt = _adamw(model)
                trainer = ORTTrainer(model, opt, TrainerOptions(), loss_fn=lambda out, batch: out)
                trainer.load_checkpoint(tmp_path / "ckpt.pt")
            losses.append(float(trainer.train_step(x=x, y=y)))
    trainer.sync_to_module()
    _same_as_eager(model, ref, opt, ref_opt, losses, ref_losses)
