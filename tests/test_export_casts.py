"""A forward that casts one of its sub-modules to what it already is (Switch Transformers'
and NLLB-MoE's routers: ``self.classifier = self.classifier.to(self.dtype)``) exports
and trains compiled (``ortrain/export_casts.py``); before, the cast failed under the
exporter's trace and the module fell back to eager."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.errors import ExportError
from ortrain.export_casts import unchanged_module_casts


class _CastsItsHead(nn.Module):
    def __init__(self, cast: str) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.cast = cast

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        if self.cast == "dtype":
            self.head = self.head.to(h.dtype)
        elif self.cast == "device":
            self.head = self.head.to(device=h.device, dtype=torch.float32)
        elif self.cast == "float":
            self.head = self.head.float()
        elif self.cast == "double":  # changes the head: float64 weights under float32 input
            self.head = self.head.double()
            h = h.double()
        return nn.functional.cross_entropy(self.head(h).float(), y)


def _batches(n: int = 3) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [{"x": torch.randn(6, 8, generator=g), "y": torch.randint(0, 4, (6,), generator=g)}
            for _ in range(n)]  # fmt: skip


@pytest.mark.parametrize("cast", ["dtype", "device", "float"])
def test_a_cast_that_changes_nothing_trains_compiled_like_eager(cast: str) -> None:
    torch.manual_seed(0)
    model = _CastsItsHead(cast)
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.2)
    trainer = ORTTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.2), TrainerOptions(fallback="off")
    )
    for batch in _batches():
        opt_ref.zero_grad()
        want = ref(**batch)
        want.backward()
        opt_ref.step()
        got = trainer.train_step(**batch)
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=0)
    trainer.sync_to_module()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)
    assert [s.kind for s in trainer.program.segments] == ["graph"]


def test_a_cast_that_changes_the_weights_still_stops_the_export() -> None:
    torch.manual_seed(0)
    model = _CastsItsHead("double")
    trainer = ORTTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.2), TrainerOptions(fallback="off")
    )
    with pytest.raises(ExportError, match=r"_CastsItsHead.*Cannot swap"):
        trainer.train_step(**_batches(1)[0])


def test_module_casts_are_untouched_outside_the_export() -> None:
    to, half = nn.Module.to, nn.Module.half
    lin = nn.Linear(2, 2)
    with unchanged_module_casts():
        assert lin.to(torch.float32) is lin and lin.float() is lin
        assert nn.Module.to is not to
        doubled = lin.double()  # a cast that changes the weights runs as before
        assert doubled.weight.dtype == torch.float64
    assert nn.Module.to is to and nn.Module.half is half
