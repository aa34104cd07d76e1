"""The model zoo (tests/zoo.py) trained through ortrain against eager, 8 AdamW steps each.

Per model: the loss of every step within 1e-4 relative, then every parameter (atol 1e-4
plus 1e-4 relative; a parameter whose eager gradient stayed at float-noise level, within
the steps' size) and every buffer (BatchNorm's running statistics, counters exactly)
against eager's, and one graph built for the run's one batch shape.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from ortrain import ORTTrainer
from ortrain.export import find_loss
from tests.zoo import ZOO, Entry

STEPS = 8
LR = 1e-3
LOSS_RTOL = 1e-4
PARAM_TOL = 1e-4
NOISE_FLOOR = 1e-6  # a gradient below this x the model's largest is float noise


def _params(entry: Entry) -> list:
    marks = [pytest.mark.slow] if entry.slow else []
    return [pytest.param(entry, id=entry.name, marks=marks)]


def train_against_eager(entry: Entry, steps: int = STEPS) -> ORTTrainer:
    torch.manual_seed(0)
    ref = entry.build()
    ref.train()
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    batches = [entry.batch(g) for _ in range(steps)]
    opt_ref = _optimizer(entry, ref)
    trainer = ORTTrainer(model, _optimizer(entry, model))
    largest: dict[str, torch.Tensor] = {}  # each element's largest |gradient| in eager
    for step, batch in enumerate(batches):
        opt_ref.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = find_loss(_call(ref, batch))
        want.backward()
        for name, p in ref.named_parameters():
            if p.grad is not None:
                seen = largest.get(name, torch.zeros_like(p))
                largest[name] = torch.maximum(seen, p.grad.detach().abs())
        opt_ref.step()
        got = _call_trainer(trainer, batch)
        torch.testing.assert_close(
            got, want.detach(), rtol=LOSS_RTOL, atol=0, msg=lambda m, k=step: f"step {k}: {m}"
        )
    trainer.sync_to_module()
    floor = NOISE_FLOOR * max(g.max().item() for g in largest.values())
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        # An element whose gradient is zero in exact arithmetic (an attention key bias:
        # softmax is shift invariant) gets float noise on both sides, and Adam turns noise
        # into steps of lr: such an element can only be held to the steps' size.
        noise = largest.get(name, torch.zeros_like(q)) <= floor
        noise &= entry.optimizer == "adamw"  # SGD moves a noise gradient by noise
        atol = torch.where(noise, LR * steps * 1.01, PARAM_TOL)
        err = (p.detach() - q.detach()).abs()
        bad = err > atol + PARAM_TOL * q.detach().abs()
        assert not bad.any(), (
            f"{name}: {int(bad.sum())}/{bad.numel()} elements differ, max error "
            f"{err.max().item():.3g}"
        )
    for (name, b), c in zip(model.named_buffers(), ref.buffers(), strict=True):
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    # one graph for the one batch shape; masked-LM heads may add a graph per bucket of
    # labelled rows (graph_passes/training/label_sparsity.py)
    assert trainer.build_count <= 3, trainer.build_count
    return trainer


def _optimizer(entry: Entry, model: torch.nn.Module) -> torch.optim.Optimizer:
    if entry.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def _positional(module: torch.nn.Module) -> bool:
    import inspect

    params = inspect.signature(module.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)


def _call(module: torch.nn.Module, batch: dict):
    return module(*batch.values()) if _positional(module) else module(**batch)


def _call_trainer(trainer: ORTTrainer, batch: dict) -> torch.Tensor:
    if _positional(trainer.module):
        return trainer.train_step(*batch.values())
    return trainer.train_step(**batch)


@pytest.mark.slow
@pytest.mark.parametrize("entry", [p for e in ZOO.values() for p in _params(e)])
def test_zoo_model_trains_like_eager(entry: Entry) -> None:
    train_against_eager(entry)


def test_zoo_covers_the_categories() -> None:
    categories = {e.category for e in ZOO.values()}
    assert {"functional", "cnn", "rnn", "embedding_bag", "hf", "moe", "ssm"} <= categories
    assert len(ZOO) >= 40
