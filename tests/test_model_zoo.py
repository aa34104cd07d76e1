"""The model zoo (tests/zoo.py) trained through ortrain against eager, 8 AdamW steps each.

Per model: the loss of every step within 1e-4 relative, then every parameter (atol 1e-4
plus 1e-4 relative) and every buffer (BatchNorm's running statistics, counters exactly)
against eager's, and one graph built for the run's one batch shape.

AdamW turns an element's float-noise gradient (zero in exact arithmetic) into steps of
about lr whose size the summation order decides, so each parameter element may also
differ by what the difference between the two sides' gradients at each step can move
Adam's steps (``tests/adam_noise.py``: nothing for a difference beyond float noise, about
lr per step for an element whose gradient is noise on both sides). ortrain's gradients
are read back after each step (recovered from the first moment where the update runs
inside the backward).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from ortrain import ORTTrainer
from ortrain.export import find_loss
from tests.adam_noise import AdamDrift, TrainerGradients, assert_params_close
from tests.zoo import ZOO, Entry

STEPS = 8
LR = 1e-3
LOSS_RTOL = 1e-4
PARAM_TOL = 1e-4


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
    opt_ref = _optimizer(ref)
    trainer = ORTTrainer(model, _optimizer(model))
    drift, ort_grads = AdamDrift(LR), TrainerGradients(trainer)
    for step, batch in enumerate(batches):
        opt_ref.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = find_loss(_call(ref, batch))
        want.backward()
        opt_ref.step()
        got = _call_trainer(trainer, batch)
        torch.testing.assert_close(
            got, want.detach(), rtol=LOSS_RTOL, atol=0, msg=lambda m, k=step: f"step {k}: {m}"
        )
        eager = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        drift.observe(eager, ort_grads(eager))
    trainer.sync_to_module()
    # every zoo model compiles whole (its first step agreed with eager): a fallback would
    # train like eager too, and hide the regression
    assert trainer.segments is None, trainer.segments.summary()
    assert_params_close(
        dict(model.named_parameters()),
        dict(ref.named_parameters()),
        rtol=PARAM_TOL,
        atol=PARAM_TOL,
        drift=drift,
    )
    for (name, b), c in zip(model.named_buffers(), ref.buffers(), strict=True):
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    # one graph for the one batch shape; masked-LM heads may add a graph per bucket of
    # labelled rows (graph_passes/training/label_sparsity.py)
    assert trainer.build_count <= 3, trainer.build_count
    return trainer


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
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
