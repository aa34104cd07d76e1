"""User code that replaces a parameter's or buffer's tensor (``p.data = p.data.clamp(...)``
between steps, WGAN's weight clipping; ``k.data = k.data * m + q.data * (1 - m)`` in the
forward, MoCo's momentum encoder; a buffer assigned anew) trains as in eager: eager's
optimizer steps the parameter object whatever its data is. The graphs and the update had
gone on with the old tensor, and ``sync_to_module`` put it back over the user's."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.errors import TrainableChangedError


class _Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 12), nn.ReLU(), nn.Linear(12, 1))
        self.register_buffer("scale", torch.tensor(1.0))

    def forward(self, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
        return self.scale * (self.net(fake).mean() - self.net(real).mean())


class _Momentum(nn.Module):
    """A query encoder trained, a key encoder following it by rebinding ``.data`` in the
    forward (as MoCo's reference code does)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(6, 6)
        self.k = nn.Linear(6, 6)
        self.k.load_state_dict(self.q.state_dict())
        self.k.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for pq, pk in zip(self.q.parameters(), self.k.parameters()):
                pk.data = pk.data * 0.5 + pq.data * 0.5
            target = self.k(x)
        return (self.q(x) - target + 1).pow(2).mean()


def _clip(model: nn.Module, c: float) -> None:
    for p in model.parameters():
        p.data = p.data.clamp(-c, c)  # a new tensor each time


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_parameters_replaced_between_steps_train_like_eager(opt):
    torch.manual_seed(0)
    model = _Critic()
    ref = copy.deepcopy(model)

    def make(m: nn.Module) -> torch.optim.Optimizer:
        if opt == "sgd":
            return torch.optim.SGD(m.parameters(), lr=0.2)
        return torch.optim.AdamW(m.parameters(), lr=0.05)

    trainer = ORTTrainer(model, make(model), TrainerOptions(build_progress=False))
    eager_opt = make(ref)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        real, fake = torch.randn(8, 5, generator=g), torch.randn(8, 5, generator=g) + 1
        loss = trainer.train_step(real, fake)
        expected = ref(real, fake)
        expected.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
        _clip(model, 0.1)
        _clip(ref, 0.1)
        if step == 1:  # a buffer assigned anew
            model.scale = torch.tensor(0.5)
            ref.scale = torch.tensor(0.5)
    trainer.sync_to_module()
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
        assert p.abs().max() <= 0.1 + 1e-7  # the clipped values, not the update's before
    sd = trainer.state_dict()["model"]
    torch.testing.assert_close(sd["net.0.weight"], ref.net[0].weight, rtol=1e-5, atol=1e-6)
    assert float(sd["scale"]) == 0.5


def test_a_frozen_copy_rebound_in_the_forward_keeps_its_values():
    torch.manual_seed(0)
    model = _Momentum()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(4, 6, generator=g) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the forward is not one graph: segments
        trainer = ORTTrainer(
            model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions(build_progress=False)
        )
        losses = [trainer.train_step(x) for x in batches]
    eager_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, loss in zip(batches, losses):
        expected = ref(x)
        expected.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    trainer.sync_to_module()
    moved = (ref.k.weight - _Momentum().k.weight).abs().max()
    assert moved > 1e-3  # the key encoder did move in eager
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


def test_a_parameter_replaced_by_another_shape_is_refused():
    torch.manual_seed(0)
    model = _Critic()
    trainer = ORTTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions(build_progress=False)
    )
    x = torch.randn(4, 5)
    trainer.train_step(x, x + 1)
    before = model.net[2].bias.detach().clone()
    model.net[0].weight.data = torch.zeros(12, 6)
    with pytest.raises(TrainableChangedError, match=r"net\.0\.weight.*\[12, 5\].*\[12, 6\]"):
        trainer.train_step(x, x + 1)
    torch.testing.assert_close(model.net[2].bias.detach(), before, rtol=0, atol=0)


class _Quantized(nn.Module):
    def __init__(self):
        super().__init__()
        import torch.ao.quantization as tq

        self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
        self.fc1, self.relu, self.fc2 = nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.fc2(self.relu(self.fc1(self.quant(x)))))


def test_quantization_aware_training_trains_like_eager():
    """``prepare_qat``'s observers make their ``min_val`` / ``scale`` buffers per channel
    on their first call (resized in place): the checks' put-back had left them zeros of the
    new shape (the moving averages started from 0), and a graph would hold the first
    call's branch. Such modules run in eager; the state follows their new buffers."""
    import torch.ao.quantization as tq

    torch.manual_seed(0)
    model = _Quantized().train()
    model.qconfig = tq.get_default_qat_qconfig("x86")
    tq.prepare_qat(model, inplace=True)
    ref = copy.deepcopy(model)

    def loss_fn(out, batch):
        return nn.functional.cross_entropy(out, batch["y"])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = ORTTrainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.05),
            TrainerOptions(build_progress=False),
            loss_fn=loss_fn,
        )
        eager_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
            loss = trainer.train_step(x, y=y)
            expected = loss_fn(ref(x), {"y": y})
            expected.backward()
            eager_opt.step()
            eager_opt.zero_grad()
            torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    assert any("buffer scale ([1] -> [32])" in str(w.message) for w in caught)
    trainer.sync_to_module()
    saved = trainer.state_dict()["model"]
    for name, t in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], t, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(saved[name], t, rtol=1e-5, atol=1e-6, msg=name)
