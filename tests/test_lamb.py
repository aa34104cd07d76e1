"""Eager ortrain.optim.Lamb against an independent float64 numpy reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ortrain.optim import Lamb


class NumpyLamb:
    """Straightforward reference: one dict of numpy arrays per parameter."""

    def __init__(self, groups: list[dict]) -> None:
        self.groups = groups
        self.state = [[{"t": 0, "m": 0.0, "v": 0.0} for _ in g["params"]] for g in groups]

    def step(self, grads: list[list[np.ndarray]]) -> None:
        for group, states, gs in zip(self.groups, self.state, grads, strict=True):
            b1, b2 = group["betas"]
            for i, (st, g) in enumerate(zip(states, gs, strict=True)):
                p = group["params"][i]
                st["t"] += 1
                st["m"] = b1 * st["m"] + (1 - b1) * g
                st["v"] = b2 * st["v"] + (1 - b2) * g * g
                m_hat, v_hat = st["m"], st["v"]
                if group["bias_correction"]:
                    m_hat = m_hat / (1 - b1 ** st["t"])
                    v_hat = v_hat / (1 - b2 ** st["t"])
                u = m_hat / (np.sqrt(v_hat) + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = math.sqrt(np.sum(p * p)), math.sqrt(np.sum(u * u))
                trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
                group["params"][i] = p - group["lr"] * trust * u


@pytest.mark.parametrize("bias_correction", [True, False])
def test_matches_numpy_reference(bias_correction: bool) -> None:
    rng = np.random.default_rng(0)
    shapes = [[(7,), (4, 5)], [(3, 2, 2), (6,)]]
    init = [[rng.standard_normal(s) for s in shp] for shp in shapes]
    init[0].append(np.zeros((3, 3)))  # ||p|| = 0 -> trust_ratio = 1 branch
    hp = [dict(lr=1e-2, weight_decay=0.01), dict(lr=3e-3, weight_decay=0.2)]
    params = [[torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in g] for g in init]
    opt = Lamb(
        [dict(params=ps, **h) for ps, h in zip(params, hp, strict=True)],
        betas=(0.8, 0.95),
        eps=1e-6,
        bias_correction=bias_correction,
    )
    ref = NumpyLamb(
        [
            dict(
                params=[a.copy() for a in g],
                betas=(0.8, 0.95),
                eps=1e-6,
                bias_correction=bias_correction,
                **h,
            )
            for g, h in zip(init, hp, strict=True)
        ]
    )
    for _ in range(6):
        grads = [[rng.standard_normal(a.shape) for a in g] for g in init]
        for ps, gs in zip(params, grads, strict=True):
            for p, g in zip(ps, gs, strict=True):
                p.grad = torch.from_numpy(g)
        opt.step()
        ref.step(grads)
        for ps, group in zip(params, ref.groups, strict=True):
            for p, expected in zip(ps, group["params"], strict=True):
                np.testing.assert_allclose(p.detach().numpy(), expected, rtol=1e-6, atol=1e-12)
    zero_param = params[0][2]
    assert zero_param.abs().sum() > 0  # the zero-initialized parameter did move
    assert opt.state[zero_param]["step"].dtype == torch.float32
    assert opt.state[zero_param]["step"].item() == 6.0


def test_skips_params_without_grad() -> None:
    a, b = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    opt = Lamb([a, b], lr=0.1)
    a.grad = torch.ones(3)
    opt.step()
    assert not torch.equal(a.detach(), torch.ones(3))
    assert torch.equal(b.detach(), torch.ones(3))
    assert b not in opt.state


def test_lr_scheduler_drives_lr() -> None:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 3))
    opt = Lamb([p], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0 if step == 0 else 1.0)
    p.grad = torch.randn(5, 3)
    before = p.detach().clone()
    opt.step()  # lr = 0.1 * 0.0
    assert torch.equal(p.detach(), before)
    assert opt.state[p]["step"].item() == 1.0  # moments still advance
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    opt.step()
    assert not torch.equal(p.detach(), before)


def test_closure_returns_loss() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = Lamb([p], lr=0.1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() == pytest.approx(5.0)
    assert p.grad is not None


def test_sparse_grad_raises() -> None:
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = Lamb(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


@pytest.mark.slow
def test_trains_tiny_mlp() -> None:
    torch.manual_seed(0)
    x = torch.randn(128, 4)
    y = torch.sin(x @ torch.tensor([[1.0], [-2.0], [0.5], [1.5]]))
    model = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = Lamb(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(200):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(lr=-1e-3),
        dict(eps=-1e-6),
        dict(betas=(1.0, 0.999)),
        dict(betas=(0.9, -0.1)),
        dict(betas=(-0.1, 0.999)),
        dict(betas=(0.9, 1.0)),
        dict(weight_decay=-0.01),
    ],
)
def test_invalid_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Lamb([torch.nn.Parameter(torch.zeros(2))], **kwargs)
