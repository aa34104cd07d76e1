"""Sub-modules called inside a ``torch.func`` transform (``vmap`` over an ensemble's
stacked weights, ``jacrev`` for a contractive penalty, ``vmap`` of a layer) run in eager:
a graph cannot take the transform's batched or tracked tensors. The segments' recording
forward had failed on them, and the trainer raised the export's error for a model eager
trains. Modules called outside the transforms only stay compiled."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev, stack_module_state

from ortrain import ORTTrainer, TrainerOptions


class _Ensemble(nn.Module):
    """Members evaluated at once by ``vmap`` over their stacked weights (torch's model
    ensembling recipe: the stacked copies are leaves, so eager trains only ``head``)."""

    def __init__(self):
        super().__init__()
        self.members = nn.ModuleList(
            [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)) for _ in range(3)]
        )
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        params, buffers = stack_module_state(list(self.members))
        base = self.members[0]

        def one(p: dict, b: dict, h: torch.Tensor) -> torch.Tensor:
            return functional_call(base, (p, b), (h,))

        out = torch.vmap(one, in_dims=(0, 0, None))(params, buffers, self.head(x))
        return ((out.mean(0) - y) ** 2).mean()


class _Contractive(nn.Module):
    """An autoencoder with the Jacobian of its encoder penalised (``vmap(jacrev(enc))``)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(5, 3), nn.Sigmoid())
        self.dec = nn.Linear(3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        jac = torch.vmap(jacrev(self.enc))(x)
        return ((self.dec(self.enc(x)) - x) ** 2).mean() + 0.1 * (jac**2).sum((1, 2)).mean()


class _VmappedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.vmap(self.lin)(x)  # x: [K, B, 4]
        return ((self.out(torch.relu(h)).mean(0) - y) ** 2).mean()


def _batches(name: str) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    if name == "ensemble":
        return [{"x": torch.randn(6, 4, generator=g), "y": torch.randn(6, 1, generator=g)}] * 3
    if name == "contractive":
        return [{"x": torch.randn(6, 5, generator=g)} for _ in range(3)]
    return [
        {"x": torch.randn(3, 6, 4, generator=g), "y": torch.randn(6, 1, generator=g)}
        for _ in range(3)
    ]


_MODELS = {"ensemble": _Ensemble, "contractive": _Contractive, "vmapped": _VmappedLayer}


@pytest.mark.parametrize("name", sorted(_MODELS))
def test_modules_called_in_a_torch_func_transform_train_like_eager(name):
    torch.manual_seed(0)
    model = _MODELS[name]()
    ref = copy.deepcopy(model)
    batches = _batches(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # not one graph: segments, with a warning
        trainer = ORTTrainer(
            model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions(build_progress=False)
        )
        losses = [trainer.train_step(**b) for b in batches]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for b, loss in zip(batches, losses):
        expected = ref(**b)
        expected.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    trainer.sync_to_module()
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
    if name == "contractive":  # the decoder is called outside jacrev only
        assert trainer._program.training.model.compiled == ["dec"]
