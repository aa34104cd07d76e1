"""TensorSlots: the per-step look that spares the parameter walks says "unchanged" only
where the walks would find what they found at the last look."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions
from ortrain.tensor_slots import TensorSlots


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh())
        self.norm = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(x)))


def _slots() -> tuple[_Net, dict[str, torch.Tensor], TensorSlots]:
    net = _Net()
    # the state holds its own tensor objects over the module's storage (as TrainingState)
    own = [*net.named_parameters(), *net.named_buffers()]
    held = {name: t.detach() for name, t in own}
    slots = TensorSlots(net, lambda kind, name: held.get(name))
    slots.take()
    return net, held, slots


def _replace_sub_module(net: _Net, held: dict) -> None:
    net.head = torch.nn.Linear(4, 1)


def _new_parameter_object(net: _Net, held: dict) -> None:
    net.head.weight = torch.nn.Parameter(net.head.weight.detach().clone())


def _new_parameter(net: _Net, held: dict) -> None:
    net.head.register_parameter("extra", torch.nn.Parameter(torch.zeros(1)))


def _data_rebound(net: _Net, held: dict) -> None:
    net.body[0].weight.data = net.body[0].weight.data.clamp(-0.1, 0.1)


def _buffer_assigned(net: _Net, held: dict) -> None:
    net.norm.running_mean = torch.zeros(4)


def _buffer_removed(net: _Net, held: dict) -> None:
    del net.norm._buffers["num_batches_tracked"]


def _state_rebinds(net: _Net, held: dict) -> None:
    held["head.bias"] = held["head.bias"].clone()


@pytest.mark.parametrize(
    "change",
    [
        _replace_sub_module,
        _new_parameter_object,
        _new_parameter,
        _data_rebound,
        _buffer_assigned,
        _buffer_removed,
        _state_rebinds,
    ],
)
def test_every_change_the_walks_would_find_is_seen(change: Callable[[_Net, dict], None]) -> None:
    net, held, slots = _slots()
    assert slots.unchanged()
    change(net, held)
    assert not slots.unchanged()


def test_values_written_in_place_are_no_change() -> None:
    net, _, slots = _slots()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    net.norm.running_mean.mul_(0.5)
    net(torch.randn(5, 3)).sum().backward()  # gradients appear; buffers update in place
    assert slots.unchanged()
    slots.forget()
    assert not slots.unchanged()


def test_a_rebound_parameter_between_steps_is_trained_like_eager() -> None:
    """The step after ``p.data = ...`` (many steps in, where the look had said
    unchanged) trains the new values, as eager's optimizer does."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    ref = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    ref.load_state_dict(net.state_dict())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    trainer = ORTTrainer(net, opt, TrainerOptions(graph_cache=False, build_progress=False),
                         loss_fn=lambda out, batch: out.square().mean())  # fmt: skip
    xs = [torch.randn(5, 3) for _ in range(6)]
    for i, x in enumerate(xs):
        if i == 4:
            net[0].weight.data = net[0].weight.data.clamp(-0.05, 0.05)
            ref[0].weight.data = ref[0].weight.data.clamp(-0.05, 0.05)
        trainer.train_step(x)
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
    trainer.sync_to_module()
    for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
