"""Optimizer state in torch's format is checked against the trainer's optimizer on every load
path (``ORTTrainer.load_state_dict``, checkpoint files, ``ORTHFTrainer``'s resume;
``ortrain/optim/state_check.py``): another optimizer's state, param groups of another count
or size, flags ortrain refuses at construction (arriving through ``param_groups``), a flag
that changes the built graph, and a step that is negative or not a whole number raise one
``CheckpointError`` (a ValueError, as torch's) naming what and where, expected against got;
a refused load changes nothing.

Torch, for comparison: group count and size mismatches raise ValueError at
``load_state_dict``; SGD's state loaded into AdamW raises ``KeyError: 'step'`` there, AdamW's
loaded into SGD ``KeyError: 'momentum'`` at the next step; ``maximize`` arriving through a
state dict is honoured (ortrain cannot: it is refused); a negative step loads."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from ortrain import CheckpointError, ORTTrainer, TrainerOptions, checkpoint
from ortrain.optim import Lamb

pytestmark = pytest.mark.shared_graphs  # many trainers of the same few models


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.out = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.fc(x)).square().mean()


X = torch.linspace(-1, 1, 8).reshape(2, 4)


def _optimizer(kind: str, model: torch.nn.Module, **kw: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, **{"momentum": 0.9, **kw})
    if kind == "lamb":
        return Lamb(model.parameters(), lr=1e-2, **kw)
    return {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[kind](
        model.parameters(), lr=1e-2, **kw
    )


def _trainer(kind: str = "adamw", accumulation: int = 1, **kw: Any) -> ORTTrainer:
    torch.manual_seed(0)
    model = Tiny()
    options = TrainerOptions(grad_accumulation_steps=accumulation)
    trainer = ORTTrainer(model, _optimizer(kind, model, **kw), options)
    for _ in range(accumulation):
        trainer.train_step(X)
    return trainer


def _eager_state(kind: str, **kw: Any) -> dict[str, Any]:
    """A torch optimizer's own state dict after one step of the same model."""
    torch.manual_seed(0)
    model = Tiny()
    opt = _optimizer(kind, model, **kw)
    model(X).backward()
    opt.step()
    return opt.state_dict()


def _snapshot(trainer: ORTTrainer) -> dict[str, Any]:
    return {
        "params": {k: v.clone() for k, v in trainer.params.items()},
        "opt_state": {k: v.clone() for k, v in trainer.opt_state.items()},
        "step": trainer.step,
        "micro_step": trainer.micro_step,
        "groups": copy.deepcopy([dict(g, params=None) for g in trainer.optimizer.param_groups]),
    }


def _unchanged(trainer: ORTTrainer, before: dict[str, Any]) -> None:
    after = _snapshot(trainer)
    assert after["step"] == before["step"] and after["micro_step"] == before["micro_step"]
    assert after["groups"] == before["groups"]
    assert after["opt_state"].keys() == before["opt_state"].keys()
    for part in ("params", "opt_state"):
        for k, v in before[part].items():
            assert torch.equal(after[part][k], v), f"{part} {k} changed"


def _refused(trainer: ORTTrainer, state: dict[str, Any], *expected: str) -> str:
    before = _snapshot(trainer)
    with pytest.raises(CheckpointError) as exc:
        trainer.load_state_dict(state)
    text = str(exc.value)
    assert "\n" not in text, text
    for part in expected:
        assert part in text, text
    _unchanged(trainer, before)
    return text


def _with_optimizer(trainer: ORTTrainer, optimizer: dict[str, Any]) -> dict[str, Any]:
    state = trainer.state_dict()
    state["optimizer"] = optimizer
    state.pop("ortrain")  # a plain torch state dict: the step comes from the optimizer's
    return state


# --------------------------------------------------------------------------- another optimizer
def test_sgd_state_into_adamw_is_refused() -> None:
    trainer = _trainer("adamw")
    _refused(
        trainer,
        _with_optimizer(trainer, _eager_state("sgd")),
        "param group 0",
        "expected AdamW's betas, eps",
        "momentum, dampening, nesterov: SGD's",
    )


def test_adamw_state_into_sgd_is_refused() -> None:
    trainer = _trainer("sgd")
    _refused(
        trainer,
        _with_optimizer(trainer, _eager_state("adamw")),
        "param group 0",
        "expected SGD's momentum, dampening, nesterov",
        "AdamW's",
    )


def test_sgd_state_into_adamw_is_refused_by_its_state_too() -> None:
    """Param groups that look right (hand-made) but SGD's per-parameter state."""
    trainer = _trainer("adamw")
    state = _with_optimizer(trainer, copy.deepcopy(trainer.state_dict()["optimizer"]))
    state["optimizer"]["state"] = _eager_state("sgd")["state"]
    _refused(
        trainer,
        state,
        "optimizer state of parameter fc.weight (index 0)",
        "expected step, exp_avg, exp_avg_sq",
        "got momentum_buffer",
    )


def test_adam_state_into_adamw_is_refused() -> None:
    """torch 2.x keeps the weight-decay style in the group: Adam's would turn AdamW into Adam."""
    trainer = _trainer("adamw")
    _refused(
        trainer,
        _with_optimizer(trainer, _eager_state("adam")),
        "decoupled_weight_decay=False",
        "AdamW",
    )


def test_lamb_state_into_adamw_is_refused() -> None:
    trainer = _trainer("adamw")
    _refused(trainer, _with_optimizer(trainer, _eager_state("lamb")), "bias_correction", "Lamb's")


def test_checkpoint_of_another_optimizer_is_refused(tmp_path) -> None:
    """Through a checkpoint file: the state of an SGD run saved in an AdamW trainer's file
    (hand-made: ortrain's own files also record the optimizer's kind)."""
    sgd = _trainer("sgd")
    trainer = _trainer("adamw")
    payload = {
        "format": checkpoint.FORMAT,
        "model_class": "Tiny",
        "optimizer_kind": "adamw",
        "state": sgd.state_dict(),
    }
    checkpoint.write_file(payload, tmp_path / "ck.pt")
    before = _snapshot(trainer)
    with pytest.raises(CheckpointError, match=r"ck\.pt: .*param group 0.*SGD's"):
        trainer.load_checkpoint(tmp_path / "ck.pt")
    _unchanged(trainer, before)


# --------------------------------------------------------------------------- groups
def test_param_groups_of_another_count_or_size_are_refused() -> None:
    trainer = _trainer("adamw")
    opt = copy.deepcopy(trainer.state_dict()["optimizer"])
    one = opt["param_groups"][0]
    opt["param_groups"] = [dict(one, params=[0, 1]), dict(one, params=[2, 3])]
    _refused(
        trainer,
        _with_optimizer(trainer, opt),
        "2 param groups",
        "the optimizer has 1",
    )
    opt["param_groups"] = [dict(one, params=[0, 1, 2])]
    _refused(
        trainer,
        _with_optimizer(trainer, opt),
        "param group 0 holds 3 parameters",
        "the optimizer's holds 4",
    )


@pytest.mark.parametrize(
    "kind, flag, value, told",
    [
        ("adamw", "maximize", True, "maximize=True is not supported"),
        ("adamw", "amsgrad", True, "amsgrad=True is not supported"),
        ("sgd", "maximize", True, "maximize=True is not supported"),
        ("sgd", "dampening", 0.5, "nesterov momentum requires dampening=0"),
    ],
)
def test_flags_refused_at_construction_are_refused_in_a_state_dict(
    kind: str, flag: str, value: Any, told: str
) -> None:
    trainer = _trainer(kind, **({"nesterov": True} if kind == "sgd" else {}))
    opt = copy.deepcopy(trainer.state_dict()["optimizer"])
    opt["param_groups"][0][flag] = value
    _refused(trainer, _with_optimizer(trainer, opt), "param group 0", told)


@pytest.mark.parametrize(
    "kind, flag, value, told",
    [
        ("sgd", "nesterov", True, "nesterov=True, the training graph was built for False"),
        ("sgd", "momentum", 0.0, "momentum=0.0"),
        ("lamb", "bias_correction", False, "bias_correction=False"),
    ],
)
def test_flags_that_change_the_built_graph_are_refused(
    kind: str, flag: str, value: Any, told: str
) -> None:
    """Today the graph would go on with the flag it was built for: silently other math."""
    trainer = _trainer(kind)
    opt = copy.deepcopy(trainer.state_dict()["optimizer"])
    opt["param_groups"][0][flag] = value
    _refused(trainer, _with_optimizer(trainer, opt), "param group 0", told)


# --------------------------------------------------------------------------- the step
@pytest.mark.parametrize("step", [-1.0, 1.5, float("nan")])
def test_a_bad_step_in_the_optimizer_state_is_refused(step: float) -> None:
    trainer = _trainer("adamw")
    opt = copy.deepcopy(trainer.state_dict()["optimizer"])
    opt["state"][1]["step"] = torch.tensor(step)
    _refused(
        trainer,
        _with_optimizer(trainer, opt),
        "optimizer state of parameter fc.bias (index 1)",
        "step must be a whole number >= 0",
        f"got {step}",
    )


@pytest.mark.parametrize(
    "key, value, told",
    [
        ("step", -3, "step must be a whole number >= 0, got -3"),
        ("step", 2.5, "step must be a whole number >= 0, got 2.5"),
        ("micro_step", 2, "micro_step must be in [0, 2) (grad_accumulation_steps), got 2"),
        ("micro_step", -1, "micro_step must be in [0, 2)"),
    ],
)
def test_bad_counters_are_refused(key: str, value: Any, told: str) -> None:
    trainer = _trainer("adamw", accumulation=2)
    state = trainer.state_dict()
    state["ortrain"][key] = value
    _refused(trainer, state, f"'ortrain' entry: {told}")


def test_a_bad_optimizer_state_index_is_refused() -> None:
    trainer = _trainer("adamw")
    opt = copy.deepcopy(trainer.state_dict()["optimizer"])
    opt["state"][-1] = opt["state"][0]
    _refused(trainer, _with_optimizer(trainer, opt), "optimizer state index -1", "0 to 3")


def test_torchs_own_state_dict_still_loads() -> None:
    """No false alarm: eager AdamW's and SGD's state dicts load into the same optimizer."""
    for kind in ("adamw", "sgd", "lamb"):
        trainer = _trainer(kind)
        eager = _eager_state(kind)
        trainer.load_state_dict(_with_optimizer(trainer, eager))
        assert trainer.step == (1 if kind != "sgd" else trainer.step)
        name = "exp_avg" if kind != "sgd" else "momentum_buffer"
        assert torch.equal(trainer.opt_state[f"{name}:fc.weight"], eager["state"][0][name])
