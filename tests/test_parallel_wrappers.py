"""A model handed over inside torch's DistributedDataParallel or DataParallel: the trainer
takes the wrapped module (one warning), which compiles whole and trains as the plain
module does; ortrain reduces over ranks itself."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from ortrain import ORTTrainer


class _Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden = torch.nn.Linear(6, 8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.out(torch.tanh(self.hidden(x))), y)


@contextlib.contextmanager
def _world_of_one() -> Iterator[None]:
    """A gloo process group of this process alone, for DistributedDataParallel."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _losses(model: torch.nn.Module, trainer: ORTTrainer) -> list[float]:
    g = torch.Generator().manual_seed(2)
    batches = [
        (torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(4)
    ]
    return [float(trainer.train_step(x, y)) for x, y in batches]


@pytest.mark.parametrize("wrapper", ["ddp", "dp"])
def test_the_wrapped_module_trains_as_the_plain_one(wrapper):
    plain = _Classifier()
    want = _losses(plain, ORTTrainer(plain, torch.optim.SGD(plain.parameters(), lr=0.1)))
    inner = _Classifier()
    with _world_of_one() if wrapper == "ddp" else contextlib.nullcontext():
        wrap = (
            torch.nn.parallel.DistributedDataParallel(inner)
            if wrapper == "ddp"
            else torch.nn.DataParallel(inner)
        )
        with pytest.warns(UserWarning, match=f"inside {type(wrap).__name__}.*not used"):
            trainer = ORTTrainer(wrap, torch.optim.SGD(wrap.parameters(), lr=0.1))
        assert trainer.module is inner
        got = _losses(inner, trainer)
    assert trainer.segments is None  # one graph: the wrapper's forward is not traced
    assert got == want
    for p, q in zip(inner.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)
