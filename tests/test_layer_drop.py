"""Models whose steps reach different parameters (LayerDrop: a layer skipped at random in
training) train like eager: the segments follow the set each step reaches, and the update
moves to the optimizer's own step, which skips a parameter without a gradient and counts
each parameter's steps (``ProgramContext.update_in_eager``, ``ortrain/segments/grads.py``).
ortrain's own eager runs leave the random generators as they were, so the first step draws
what eager's would (``ortrain/python_state.py``).
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
from ortrain.checkpoint import uneven_steps
from ortrain.core.errors import BatchError
from ortrain.python_state import random_states_kept

RTOL = 1e-5


class _Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h + torch.nn.functional.gelu(self.lin(h)))


class LayerDropNet(nn.Module):
    """Blocks each skipped with probability ``p`` in training, decided by a coin from
    torch's generator in Python (as transformers' LayerDrop does); ``ran`` records which
    blocks each forward ran."""

    def __init__(self, d: int = 12, n: int = 4, p: float = 0.5):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(n))
        self.head = nn.Linear(d, 3)
        self.p = p
        self.ran: list[tuple[int, ...]] | None = None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, ran = self.inp(x), []
        for i, block in enumerate(self.blocks):
            if self.training and torch.rand([]) < self.p:
                continue
            ran.append(i)
            h = block(h)
        if self.ran is not None:
            self.ran.append(tuple(ran))
        return torch.nn.functional.cross_entropy(self.head(h), y)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(n)
    ]


def _eager(model: nn.Module, opt: torch.optim.Optimizer, batches, accum: int) -> list[float]:
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = model(x, y)
        (loss / accum).backward()
        losses.append(loss.item())
        if (i + 1) % accum == 0:
            opt.step()
            opt.zero_grad()
    return losses


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.95)),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
}


def _assert_like(trained: nn.Module, ref: nn.Module) -> None:
    for (name, p), q in zip(trained.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "accum", "steps"), [("adamw", 1, 10), ("sgd-momentum", 1, 10), ("adam", 3, 6)]
)
def test_layer_drop_trains_like_eager(kind, accum, steps):
    torch.manual_seed(0)
    model = LayerDropNet()
    ref = copy.deepcopy(model)
    model.ran, ref.ran = [], []
    batches = _batches(steps * accum)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = ORTTrainer(
            model,
            OPTIMIZERS[kind](model.parameters()),
            TrainerOptions(build_progress=False, grad_accumulation_steps=accum),
        )
        torch.manual_seed(5)
        losses = [trainer.train_step(x, y).item() for x, y in batches]
    torch.manual_seed(5)
    expected = _eager(ref, OPTIMIZERS[kind](ref.parameters()), batches, accum)
    # the same coins: ortrain's recording forward and checks drew none of the step's
    assert model.ran == ref.ran
    first = set(ref.ran[0])
    assert any(first - set(r) for r in ref.ran[1:]), "no step skipped a block the first ran"
    assert any(set(r) - first for r in ref.ran[1:]), "no step ran a block the first skipped"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL, atol=0)
    _assert_like(model, ref)
    assert trainer.segments is not None and trainer.update_engine.name == "eager"
    moved = [w for w in caught if "runs as its own step() in eager" in str(w.message)]
    assert len(moved) == 1, [str(w.message) for w in caught]
    # per parameter, the steps torch counted: the blocks' differ (Adam's bias correction)
    if kind != "sgd-momentum":
        assert uneven_steps(trainer.state_dict())


@pytest.mark.slow
def test_a_state_dict_with_uneven_steps_resumes_like_eager():
    torch.manual_seed(0)
    model = LayerDropNet()
    ref = copy.deepcopy(model)
    batches = _batches(10)
    options = TrainerOptions(build_progress=False)
    trainer = ORTTrainer(model, OPTIMIZERS["adamw"](model.parameters()), options)
    fresh = LayerDropNet()  # (made before the coins are drawn: its init draws too)
    torch.manual_seed(5)
    for x, y in batches[:5]:
        trainer.train_step(x, y)
    saved = trainer.state_dict()
    assert uneven_steps(saved)

    resumed = ORTTrainer(fresh, OPTIMIZERS["adamw"](fresh.parameters()), options)
    resumed.load_state_dict(saved)
    losses = [resumed.train_step(x, y).item() for x, y in batches[5:]]
    torch.manual_seed(5)
    expected = _eager(ref, OPTIMIZERS["adamw"](ref.parameters()), batches, 1)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected[5:]), rtol=RTOL, atol=0)
    _assert_like(fresh, ref)


@pytest.mark.slow
def test_an_engine_the_options_name_keeps_one_set_and_says_why():
    torch.manual_seed(0)
    model = LayerDropNet(p=0.5)
    options = TrainerOptions(build_progress=False, update_engine="graph")
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), options)
    torch.manual_seed(5)
    with pytest.raises(BatchError, match=r"update_engine='graph'.*LayerDrop"):
        for x, y in _batches(10):
            trainer.train_step(x, y)


def test_uneven_steps_names_the_counts():
    def sd(*steps):
        state = {i: {"step": torch.tensor(float(s))} for i, s in enumerate(steps)}
        return {"optimizer": {"state": state}}

    assert uneven_steps(sd(3, 3, 3)) == ""
    assert uneven_steps(sd(3, 5, 3)) == "3 and 5"
    assert uneven_steps({"optimizer": {"state": {0: {"momentum_buffer": torch.ones(1)}}}}) == ""
    assert uneven_steps({"model": {}}) == ""


def test_random_states_kept_puts_every_generator_back():
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    with random_states_kept():
        torch.rand(4), np.random.rand(4), random.random()
    after = (torch.rand(2), np.random.rand(2), random.random())
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    fresh = (torch.rand(2), np.random.rand(2), random.random())
    assert torch.equal(after[0], fresh[0])
    assert np.array_equal(after[1], fresh[1]) and after[2] == fresh[2]
