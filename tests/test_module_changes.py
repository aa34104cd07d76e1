"""A module changed after its graphs were built: a sub-module assigned anew, a forward
(pre-)hook or torch's global module hook added or removed, trains as eager does from the
next step (the graphs are built again and checked). New Parameter objects under the
optimizer's names (a layer replaced, ``load_state_dict(assign=True)``) are refused before
the step. Before: the graphs kept the forward their export saw, silently, and the state
adopted the new parameters' values and trained them where eager's optimizer steps the old
objects."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as nn_module

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.errors import TrainableChangedError
from ortrain.module_structure import changes, structure

pytestmark = pytest.mark.shared_graphs  # many trainers of the same few models


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 8)
        self.act = nn.ReLU()
        self.l2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.l2(self.act(self.l1(x))), y)


class _WithDet(_Net):
    """The same with a part that is no graph (Det has no gradient rule): segments."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        det = torch.linalg.det(self.score(x).reshape(-1, 2, 2))
        return super().forward(x, y) + 0.01 * det.mean()


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    return [
        (torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)
    ]


_HANDLES: list = []


def _swap_act(m: nn.Module, step: int) -> None:
    if step == 2:
        m.act = nn.GELU()


def _toggle_forward_hook(m: nn.Module, step: int) -> None:
    if step == 1:
        _HANDLES.append(m.l1.register_forward_hook(lambda mod, i, o: o * 2))
    if step == 3:
        _HANDLES.pop().remove()


def _pre_hook(m: nn.Module, step: int) -> None:
    if step == 2:
        m.l2.register_forward_pre_hook(lambda mod, a: (a[0] * 0.5,))


def _global_hook(m: nn.Module, step: int) -> None:
    if step == 1:
        _HANDLES.append(
            nn_module.register_module_forward_hook(
                lambda mod, i, o: o * 1.5 if isinstance(mod, nn.Linear) else None
            )
        )
    if step == 3:
        _HANDLES.pop().remove()


CHANGES = {
    "sub-module assigned anew": (_swap_act, "act assigned anew"),
    "forward hook added then removed": (_toggle_forward_hook, "l1: forward hooks changed"),
    "forward pre-hook added": (_pre_hook, "l2: forward pre hooks changed"),
    "global module hook added then removed": (_global_hook, "global module hooks"),
}


def _train(
    make: Callable[[], nn.Module], change: Callable, ortrain: bool, steps: int = 5
) -> tuple[list[float], nn.Module, ORTTrainer | None]:
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = ORTTrainer(model, opt, TrainerOptions()) if ortrain else None
    losses = []
    try:
        for i, (x, y) in enumerate(_batches(steps)):
            change(model, i)
            if trainer is not None:
                losses.append(float(trainer.train_step(x, y)))
            else:
                loss = model(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(float(loss))
    finally:
        while _HANDLES:
            _HANDLES.pop().remove()
    if trainer is not None:
        trainer.sync_to_module()
    return losses, model, trainer


@pytest.mark.parametrize("make", [_Net, _WithDet], ids=["whole graph", "segments"])
@pytest.mark.parametrize("what", list(CHANGES))
def test_a_module_changed_between_steps_trains_like_eager(what: str, make) -> None:
    change, said = CHANGES[what]
    want, ref, _ = _train(make, change, ortrain=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, model, trainer = _train(make, change, ortrain=True)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)
    told = [str(w.message) for w in caught if "modules or hooks changed" in str(w.message)]
    assert told and said in told[0], told
    assert (trainer.segments is not None) == (make is _WithDet)


def test_an_unchanged_model_builds_once_and_warns_nothing() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, trainer = _train(_Net, lambda m, i: None, ortrain=True)
    assert trainer.build_count == 1
    assert not [w for w in caught if "modules or hooks" in str(w.message)]


def _replace_head(m: nn.Module, step: int) -> None:
    if step == 2:
        m.l2 = nn.Linear(8, 3)


def _assign_state(m: nn.Module, step: int) -> None:
    if step == 2:
        m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True)


@pytest.mark.parametrize(
    "change, names",
    [(_replace_head, "l2.weight, l2.bias"), (_assign_state, "l1.weight, l1.bias, l2.weight")],
    ids=["layer replaced", "load_state_dict(assign=True)"],
)
def test_new_parameter_objects_are_refused_before_the_step(change, names: str) -> None:
    """Eager's optimizer would step the old objects and leave the module's new ones
    untrained; ortrain had trained them. Nothing of the refused step runs."""
    torch.manual_seed(0)
    model = _Net()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions())
    batches = _batches(3)
    for x, y in batches[:2]:
        trainer.train_step(x, y)
    before = {k: v.clone() for k, v in trainer.state.params.items()}
    change(model, 2)
    with pytest.raises(TrainableChangedError, match="replaced or removed: " + names):
        trainer.train_step(*batches[2])
    for k, v in before.items():
        assert torch.equal(trainer.state.params[k], v), k


def test_structure_names_each_kind_of_change() -> None:
    m = _Net()
    before = structure(m)
    assert changes(before, structure(m)) == []
    m.act = nn.Tanh()
    h = m.l1.register_full_backward_hook(lambda mod, gi, go: None)
    m.extra = nn.Identity()
    said = changes(before, structure(m))
    h.remove()
    assert said == ["l1: backward hooks changed", "act assigned anew", "extra added"]
