"""A checkpoint taken inside a gradient-accumulation window resumes that window: its
gradients so far are saved with it (one process), so the resumed run ends the window on
all of its micro-batches, as the run without the stop does. Before, the micro-step count
was saved without the gradients: the resumed window ended on fewer micro-batches'
gradients, silently (parameters off by a whole AdamW step)."""

from __future__ import annotations

import warnings

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions
from ortrain.checkpoint import trainer_state_dict
from tests.conftest import gpt2, lm_batches

pytestmark = pytest.mark.shared_graphs

WINDOW = 3
STOP = 4  # micro-batches before the checkpoint: micro-step 1 of the second window
BATCHES = 8


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.RMSprop(model.parameters(), lr=1e-3)  # its own step, in eager


def _trainer(kind: str, segments: bool) -> tuple[torch.nn.Module, ORTTrainer]:
    model = gpt2(layers=1, hidden=32, vocab=64, seed=4)
    options = TrainerOptions(grad_accumulation_steps=WINDOW, max_grad_norm=1.0)
    if segments:
        options = TrainerOptions(
            grad_accumulation_steps=WINDOW, max_grad_norm=1.0, segments="blocks"
        )
    return model, ORTTrainer(model, _optimizer(kind, model), options)


@pytest.mark.parametrize(
    "kind,segments,api",
    [
        ("adamw", False, "file"),
        ("adamw", True, "state_dict"),
        ("rmsprop", False, "state_dict"),
        ("sgd", True, "file"),
    ],
    ids=["adamw-whole-file", "adamw-segments-dict", "rmsprop-whole-dict", "sgd-segments-file"],
)
def test_a_checkpoint_inside_a_window_resumes_it(tmp_path, kind, segments, api):
    batches = lm_batches(BATCHES, batch=2, seq=16, vocab=64)
    whole_model, whole = _trainer(kind, segments)
    for b in batches:
        whole.train_step(**b)
    whole.sync_to_module()

    _, first = _trainer(kind, segments)
    for b in batches[:STOP]:
        first.train_step(**b)
    assert first.micro_step == STOP % WINDOW
    path = tmp_path / "mid-window.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing is left out: no warning
        if api == "file":
            first.save_checkpoint(path)
        else:
            saved = first.state_dict()
    resumed_model, resumed = _trainer(kind, segments)  # fresh: no graph, no gradients yet
    if api == "file":
        resumed.load_checkpoint(path)
    else:
        resumed.load_state_dict(saved)
    assert resumed.micro_step == STOP % WINDOW
    for b in batches[STOP:]:
        resumed.train_step(**b)
    resumed.sync_to_module()
    for (name, p), q in zip(resumed_model.named_parameters(), whole_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
    assert resumed.step == whole.step == BATCHES // WINDOW


def test_a_trainer_mid_training_takes_a_window_back() -> None:
    """Loaded into a trainer whose gradients are laid out (it trained on): they become
    the saved window's, and the same micro-batches give the same parameters again."""
    batches = lm_batches(BATCHES, batch=2, seq=16, vocab=64)
    model, trainer = _trainer("adamw", False)
    for b in batches[:STOP]:
        trainer.train_step(**b)
    saved = trainer.state_dict()
    for b in batches[STOP:]:
        trainer.train_step(**b)
    trainer.sync_to_module()
    once = [p.detach().clone() for p in model.parameters()]
    trainer.load_state_dict(saved)
    for b in batches[STOP:]:
        trainer.train_step(**b)
    trainer.sync_to_module()
    for p, q in zip(model.parameters(), once, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_window_saved_without_its_gradients_starts_anew_with_a_warning() -> None:
    """A distributed rank's state (each rank holds its own partial sums) or an older
    checkpoint: saved and loaded at a window's start, each with a warning."""
    batches = lm_batches(STOP, batch=2, seq=16, vocab=64)
    _, trainer = _trainer("adamw", False)
    for b in batches:
        trainer.train_step(**b)
    with pytest.warns(UserWarning, match="saved at micro-step 1 of a 3-micro-step"):
        state = trainer_state_dict(trainer._ctx.state)  # as a distributed reducer asks
    assert state["ortrain"]["micro_step"] == 0 and "window_grads" not in state["ortrain"]
    older = trainer.state_dict()
    del older["ortrain"]["window_grads"]
    _, fresh = _trainer("adamw", False)
    with pytest.warns(UserWarning, match="loaded without its gradients"):
        fresh.load_state_dict(older)
    assert fresh.micro_step == 0
