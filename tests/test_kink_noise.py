"""The first-step check tells a kink flipped by rounding from a wrong gradient
(``ortrain/verify.py``, ``beyond_kinks``): a graph whose gradients differ from eager's
only where a ReLU's input sits at its kink is trusted; one with a wrong rule is not, in
the same model."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.errors import VerificationError
from ortrain.verify import KINK_PROBES, beyond_kinks

H = 8


class _AtTheKink(torch.nn.Module):
    """A ReLU layer whose every unit reads exactly 0 on the batch's first row
    (``c * 0.5 - c * 0.5``, exact in float32 and float64), so the gradient there is
    ReLU's at its kink: torch takes 0; another convention, or rounding's last bit on
    either side, takes the whole term."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(2, H, bias=False)
        self.out = torch.nn.Linear(H, 1)
        c = torch.linspace(0.5, 2.0, H)
        with torch.no_grad():  # every weight set: the kink's term is the same on any run
            self.hidden.weight.copy_(torch.stack([c, -c], 1))
            self.out.weight.copy_(torch.linspace(-1.0, 1.0, H)[None])
            self.out.bias.fill_(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x))).square().mean()


def _batch() -> torch.Tensor:
    return torch.tensor([[0.5, 0.5], [1.0, -0.3], [-0.2, 0.7], [0.9, 0.1]])


def _relu_rule(monkeypatch, scale: float, at_zero: bool) -> None:
    """A test-only Relu rule: ``dy * scale`` where ``x > 0`` (and where ``x == 0`` if
    ``at_zero``): scale 1 with at_zero is a kink convention, scale 1.5 a wrong rule."""
    from ortrain.graph_passes.autodiff import registry

    (right,) = registry._TABLE[("", "Relu")]

    def rule(ctx):
        x = ctx.I(0)
        zero = ctx.scalar_like(0.0, x)
        on = ctx.op("GreaterOrEqual" if at_zero else "Greater", x, zero, dtype=None)
        dy = ctx.op("Mul", ctx.GO(0), ctx.scalar_like(scale, x))
        return {0: ctx.op("Where", on, dy, zero, dtype=x.dtype)}

    monkeypatch.setitem(registry._TABLE, ("", "Relu"), [dataclasses.replace(right, fn=rule)])


def test_a_graph_differing_only_at_a_kink_is_trusted_whole(monkeypatch) -> None:
    _relu_rule(monkeypatch, 1.0, at_zero=True)
    model = _AtTheKink()
    ref = copy.deepcopy(model)
    options = TrainerOptions(fallback="off", graph_cache=False, cpu_kernels="onnxruntime")
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=1.0), options)
    before = copy.deepcopy(model.hidden.weight.detach())
    loss = trainer.train_step(x=_batch())  # checked against eager; no VerificationError
    assert trainer.segments is None
    want = ref(_batch())
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=0)
    trainer.sync_to_module()
    got = before - model.hidden.weight.detach()
    # the graph's gradient did take the kink's term: it is not eager's
    assert (got - ref.hidden.weight.grad).abs().max() > 1e-2


def test_a_wrong_rule_is_still_caught_in_a_model_with_kinks(monkeypatch) -> None:
    _relu_rule(monkeypatch, 1.5, at_zero=False)
    model = _AtTheKink()
    options = TrainerOptions(fallback="off", graph_cache=False, cpu_kernels="onnxruntime")
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=1.0), options)
    with pytest.raises(VerificationError, match=r"hidden\.weight"):
        trainer.train_step(x=_batch())


def test_a_rule_that_makes_nans_is_caught_though_the_loss_agrees(monkeypatch) -> None:
    """NaN gradients where eager's are numbers are no difference of size for the kink
    probe to weigh (``max(0.0, nan)`` is 0.0 in Python: it had excused them)."""
    from ortrain.graph_passes.autodiff import registry

    (right,) = registry._TABLE[("", "Relu")]

    def rule(ctx):  # the right gradient plus 0 * sqrt(x): NaN where x < 0
        (dx,) = right.fn(ctx).values()
        nan_where_negative = ctx.op("Mul", ctx.op("Sqrt", ctx.I(0)), ctx.scalar_like(0.0, dx))
        return {0: ctx.op("Add", dx, nan_where_negative)}

    monkeypatch.setitem(registry._TABLE, ("", "Relu"), [dataclasses.replace(right, fn=rule)])
    model = _AtTheKink()
    options = TrainerOptions(fallback="off", graph_cache=False, cpu_kernels="onnxruntime")
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=1.0), options)
    with pytest.raises(VerificationError, match="non-finite values differ"):
        trainer.train_step(x=_batch())


def _grads(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"a": scale * torch.randn(64, generator=gen), "b": scale * torch.randn(8, generator=gen)}


def test_beyond_kinks_weighs_the_graph_against_the_nudged_steps() -> None:
    exact = _grads(0)
    flipped = {k: v.clone() for k, v in exact.items()}
    flipped["a"][3] += 2.0  # one element moved by a whole term
    rounded = {k: v * (1 + 1e-7) for k, v in exact.items()}

    def nudged_alike(i: int) -> dict[str, torch.Tensor]:
        out = {k: v.clone() for k, v in exact.items()}
        out["a"][10 + i] -= 1.5  # a kink elsewhere flips under the nudge
        return out

    calls = []

    def nudged_smooth(i: int) -> dict[str, torch.Tensor]:
        calls.append(i)
        return rounded

    assert not beyond_kinks(flipped, exact, nudged_alike, 1e-3)
    assert beyond_kinks(flipped, exact, nudged_smooth, 1e-3)  # a smooth model: it stands
    assert calls == list(range(KINK_PROBES))
    assert beyond_kinks(flipped, exact, lambda i: None, 1e-3)  # no probe: it stands
    assert beyond_kinks({"a": exact["a"]}, exact, nudged_alike, 1e-3)  # a gradient missing
    nan = {k: v.clone() for k, v in exact.items()}
    nan["b"][0] = float("nan")
    assert beyond_kinks(nan, exact, nudged_alike, 1e-3)  # a NaN where eager has a number
    # a gradient eager does not have (a parameter eager trains none of)
    assert beyond_kinks({**exact, "c": torch.ones(3)}, {**exact, "c": None}, nudged_alike, 1e-3)
    # past KINK_CEILING of the norms, whatever the spread: it stands
    assert beyond_kinks({k: 1.5 * v for k, v in exact.items()}, exact, nudged_alike, 1e-3)

    def nudged_little(i: int) -> dict[str, torch.Tensor]:
        out = {k: v.clone() for k, v in exact.items()}
        out["a"][10 + i] -= 0.3
        return out

    # beyond KINK_FACTOR times the nudged steps' spread: it stands
    assert beyond_kinks({k: 1.2 * v for k, v in exact.items()}, exact, nudged_little, 1e-3)
    assert not beyond_kinks(rounded, exact, nudged_little, 1e-3)
