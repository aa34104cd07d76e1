"""A forward that differentiates its own outputs with ``create_graph=True`` (a WGAN-GP
gradient penalty, second-order MAML, a physics-informed loss on du/dx) needs the
second-order terms of every module on that path. A compiled segment's backward graph
is first-order: used there, it dropped those terms and trained another loss with no
error. The recording forward finds such modules (``ortrain/segments/twice.py``), which
run in eager; a compiled one differentiated so later raises instead.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from ortrain import ORTTrainer, TrainerOptions
from ortrain.segments.partition import record_calls
from ortrain.segments.twice import SecondOrderError


class _GradientPenalty(nn.Module):
    """A critic's Wasserstein loss plus its gradient penalty at interpolated inputs;
    ``every``: the penalty on steps whose index is a multiple of it (a lazy regulariser)."""

    def __init__(self, every: int = 1):
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.head = nn.Linear(6, 6)  # first-order only: stays compiled
        self.every, self.calls = every, 0

    def forward(self, real: torch.Tensor, fake: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        fake = self.head(fake)
        loss = self.critic(fake).mean() - self.critic(real).mean()
        self.calls += 1
        if (self.calls - 1) % self.every == 0:
            mixed = (eps * real + (1 - eps) * fake.detach()).requires_grad_(True)
            (g,) = torch.autograd.grad(self.critic(mixed).sum(), mixed, create_graph=True)
            loss = loss + 10.0 * ((g.norm(dim=1) - 1) ** 2).mean()
        return loss


class _Maml(nn.Module):
    """One inner SGD step taken with ``create_graph=True``, the outer loss on the adapted
    weights (second-order MAML)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(1, 16), nn.Linear(16, 1)

    def forward(self, xs, ys, xq, yq):
        inner = nn.functional.mse_loss(self.l2(torch.tanh(self.l1(xs))), ys)
        params = [self.l1.weight, self.l1.bias, self.l2.weight, self.l2.bias]
        grads = torch.autograd.grad(inner, params, create_graph=True)
        w1, b1, w2, b2 = (p - 0.1 * g for p, g in zip(params, grads))
        pred = nn.functional.linear(torch.tanh(nn.functional.linear(xq, w1, b1)), w2, b2)
        return nn.functional.mse_loss(pred, yq)


class _MamlClassifier(nn.Module):
    """Second-order MAML on a classifier: cross-entropy losses inside and outside
    (eager's own cross-entropy, not the segments' pooled one: ``segments/pooled_loss.py``)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(2, 16), nn.Linear(16, 3)

    def forward(self, xs, ys, xq, yq):
        inner = nn.functional.cross_entropy(self.l2(torch.tanh(self.l1(xs))), ys)
        params = [self.l1.weight, self.l1.bias, self.l2.weight, self.l2.bias]
        grads = torch.autograd.grad(inner, params, create_graph=True)
        w1, b1, w2, b2 = (p - 0.1 * g for p, g in zip(params, grads))
        logits = nn.functional.linear(torch.tanh(nn.functional.linear(xq, w1, b1)), w2, b2)
        return nn.functional.cross_entropy(logits, yq)


class _Pinn(nn.Module):
    """u(x) with the residual of u'' + u = 0 and a boundary term."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone().requires_grad_(True)
        u = self.net(x)
        (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        (d2u,) = torch.autograd.grad(du.sum(), x, create_graph=True)
        boundary = self.net(torch.zeros(1, 1)) - 1.0
        return ((d2u + u) ** 2).mean() + (boundary**2).mean()


class _FirstOrderFeature(nn.Module):
    """A gradient taken in the forward without ``create_graph`` and used as a constant."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone().requires_grad_(True)
        h = torch.tanh(self.body(x))
        (g,) = torch.autograd.grad(h.sum(), x, retain_graph=True)
        return (self.out(h + g) ** 2).mean()


def _batches(name: str, n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        if name == "penalty":
            out.append(
                {
                    "real": torch.randn(8, 6, generator=g),
                    "fake": torch.randn(8, 6, generator=g),
                    "eps": torch.rand(8, 1, generator=g),
                }
            )
        elif name == "maml-ce":
            xs, xq = torch.randn(6, 2, generator=g), torch.randn(6, 2, generator=g)
            ys, yq = torch.randint(0, 3, (6,), generator=g), torch.randint(0, 3, (6,), generator=g)
            out.append({"xs": xs, "ys": ys, "xq": xq, "yq": yq})
        elif name == "maml":
            xs, xq = torch.rand(5, 1, generator=g) * 6 - 3, torch.rand(5, 1, generator=g) * 6 - 3
            a = torch.rand(1, generator=g) + 0.5
            out.append({"xs": xs, "ys": a * torch.sin(xs), "xq": xq, "yq": a * torch.sin(xq)})
        else:
            out.append({"x": torch.rand(12, 1, generator=g) * 2 - 1})
    return out


_MODELS = {"penalty": _GradientPenalty, "maml": _Maml, "maml-ce": _MamlClassifier, "pinn": _Pinn}


def _eager_losses(model: nn.Module, batches: list[dict]) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for b in batches:
        loss = model(**b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", sorted(_MODELS))
def test_a_forward_that_differentiates_twice_trains_like_eager(name):
    torch.manual_seed(0)
    model = _MODELS[name]()
    ref = copy.deepcopy(model)
    batches = _batches(name, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = ORTTrainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.05),
            TrainerOptions(build_progress=False),
        )
        losses = [trainer.train_step(**b).item() for b in batches]
    expected = _eager_losses(ref, batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    trainer.sync_to_module()
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
    said = "\n".join(str(w.message) for w in caught)
    assert "create_graph=True" in said  # the module left in eager, and why


def test_only_the_modules_on_the_twice_differentiated_path_are_named():
    torch.manual_seed(0)
    model = _GradientPenalty()
    b = _batches("penalty", 1)[0]
    recorded = record_calls(model, lambda: model(**b))
    # the penalty differentiates the critic (and its layers); the head's output is detached
    assert recorded.twice == {"critic", "critic.0", "critic.1", "critic.2"}
    first = _FirstOrderFeature()
    x = torch.randn(3, 4)
    assert record_calls(first, lambda: first(x)).twice == frozenset()


def test_a_first_order_gradient_in_the_forward_stays_compiled():
    torch.manual_seed(0)
    model = _FirstOrderFeature()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    batches = [{"x": torch.randn(6, 4, generator=g)} for _ in range(3)]
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        trainer = ORTTrainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.05),
            TrainerOptions(build_progress=False),
        )
        losses = [trainer.train_step(**b).item() for b in batches]
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(_eager_losses(ref, batches)), rtol=1e-5, atol=1e-6
    )
    program = trainer._program
    assert sorted(program.training.model.compiled) == ["body", "out"]


def test_a_penalty_first_taken_after_the_first_step_raises_and_keeps_the_weights():
    torch.manual_seed(0)
    model = _GradientPenalty(every=2)  # the penalty on steps 0, 2, ...: not on step 1
    model.calls = 1  # the first training step has no penalty
    batches = _batches("penalty", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = ORTTrainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.05),
            TrainerOptions(build_progress=False),
        )
        trainer.train_step(**batches[0])
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(SecondOrderError, match="create_graph=True"):
            trainer.train_step(**batches[1])
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=0, msg=n)
