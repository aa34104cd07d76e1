"""A training loop that empties ``optimizer.state`` (``ortrain/optimizer_resets.py``):
torch's optimizer starts every parameter's state again, and so does the compiled update;
ortrain's own handing of the state to torch and back, and a loaded state, are not such a
reset. One that resets one parameter's state (a layer re-initialised) trains on as
eager does, the update then the optimizer's own step."""

from __future__ import annotations

import collections
import copy
import warnings
from collections.abc import Callable

import pytest
import torch

from ortrain import ORTTrainer

pytestmark = pytest.mark.shared_graphs  # many trainers of the same few models

STEPS, RESET_AT = 7, 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 2))


def _loss(out: torch.Tensor, batch: dict) -> torch.Tensor:
    return (out - batch["y"]).pow(2).mean()


def _clear(opt: torch.optim.Optimizer) -> None:
    opt.state.clear()


def _assign(opt: torch.optim.Optimizer) -> None:
    opt.state = collections.defaultdict(dict)


def _reload(opt: torch.optim.Optimizer) -> None:
    opt.load_state_dict(opt.state_dict())  # what it holds: nothing restarts


def _sync(trainer: ORTTrainer | None) -> None:
    if trainer is not None:
        trainer.sync_to_module()  # the state handed to torch, then taken back unchanged


OPTIMIZERS: dict[str, Callable] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=2e-2, weight_decay=0.1),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=5e-2, momentum=0.9, nesterov=True),
}


def _run(make_opt: Callable, at_reset: Callable, ortrain: bool) -> tuple[list[float], list]:
    model = _model()
    opt = make_opt(model.parameters())
    trainer = ORTTrainer(model, opt, loss_fn=_loss) if ortrain else None
    g = torch.Generator().manual_seed(1)
    losses = []
    for i in range(STEPS):
        if i == RESET_AT:
            at_reset(opt, trainer)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)
        if trainer is not None:
            losses.append(float(trainer.train_step(x, y=y)))
        else:
            loss = _loss(model(x), {"y": y})
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize(
    "at_reset",
    [
        lambda opt, trainer: _clear(opt),
        lambda opt, trainer: _assign(opt),
        lambda opt, trainer: _reload(opt),
        lambda opt, trainer: _sync(trainer),
    ],
    ids=["clear", "assign", "reload", "sync"],
)
def test_an_emptied_state_starts_again_as_torch_does(optimizer: str, at_reset: Callable) -> None:
    make = OPTIMIZERS[optimizer]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want_losses, want = _run(make, at_reset, ortrain=False)
        got_losses, got = _run(make, at_reset, ortrain=True)
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=0)
    for i, (p, q) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"parameter {i}")


def test_the_restart_shows_in_the_step_count_and_the_moments() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = ORTTrainer(model, opt, loss_fn=_loss)
    x, y = torch.randn(5, 6), torch.randn(5, 2)
    for _ in range(3):
        trainer.train_step(x, y=y)
    assert trainer.step == 3 and not opt.state  # ortrain holds the state
    moments = copy.deepcopy(opt.state_dict()["state"])
    assert any(bool(s["exp_avg"].any()) for s in moments.values())
    opt.state.clear()
    trainer.train_step(x, y=y)
    assert trainer.step == 1  # the one update since the restart, as torch's per-parameter steps
    after = opt.state_dict()["state"]
    assert {float(s["step"]) for s in after.values()} == {1.0}


def _assign_one(opt: torch.optim.Optimizer) -> None:
    opt.state[opt.param_groups[0]["params"][0]] = {}


def _del_one(opt: torch.optim.Optimizer) -> None:
    p = opt.param_groups[0]["params"][0]
    if p in opt.state or not isinstance(opt.state, collections.defaultdict):
        del opt.state[p]
    else:  # ortrain's: the compiled update's state is elsewhere (no KeyError)
        del opt.state[p]


def _pop_one(opt: torch.optim.Optimizer) -> None:
    opt.state.pop(opt.param_groups[0]["params"][0], None)


def _read_one(opt: torch.optim.Optimizer) -> None:
    assert isinstance(opt.state[opt.param_groups[0]["params"][1]], dict)  # not a reset


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize(
    "at_reset",
    [
        lambda opt, trainer: _assign_one(opt),
        lambda opt, trainer: _del_one(opt),
        lambda opt, trainer: _pop_one(opt),
    ],
    ids=["assign", "del", "pop"],
)
def test_one_parameter_s_state_reset_trains_as_torch_does(
    optimizer: str, at_reset: Callable
) -> None:
    """``state[p] = {}``, ``del state[p]``, ``state.pop(p, None)`` for the first layer's
    weight: torch starts its moments (and Adam's step count) again while the others go
    on. Before, the first raised ``CheckpointError`` at the next step, ``del`` raised
    ``KeyError`` and ``pop`` changed nothing (3.8e-2 off after two more steps)."""
    make = OPTIMIZERS[optimizer]
    want_losses, want = _run(make, at_reset, ortrain=False)
    with pytest.warns(UserWarning, match=r"reset the optimizer state of 0\.weight; .* own step"):
        got_losses, got = _run(make, at_reset, ortrain=True)
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=0)
    for i, (p, q) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"parameter {i}")


def test_every_parameter_s_state_reset_one_by_one_is_a_restart() -> None:
    """Each parameter's entry reset: the whole state starts again, the update stays
    compiled."""

    def reset_all(opt: torch.optim.Optimizer, trainer: ORTTrainer | None) -> None:
        for p in opt.param_groups[0]["params"]:
            opt.state[p] = {}

    make = OPTIMIZERS["adamw"]
    want_losses, want = _run(make, reset_all, ortrain=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no move to the optimizer's own step
        got_losses, got = _run(make, reset_all, ortrain=True)
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=0)
    for i, (p, q) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"parameter {i}")


def test_a_read_of_a_parameter_s_state_is_no_reset() -> None:
    """``optimizer.state[p]`` read (torch's defaultdict makes an empty entry): training
    goes on compiled, as if nothing happened, and equals eager."""
    make = OPTIMIZERS["adamw"]
    want_losses, want = _run(make, lambda opt, trainer: _read_one(opt), ortrain=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got_losses, got = _run(make, lambda opt, trainer: _read_one(opt), ortrain=True)
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=0)
    for i, (p, q) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"parameter {i}")
