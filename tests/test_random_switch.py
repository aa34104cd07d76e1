"""Random draws fixed on both sides of the first-step check, so a graph that draws is
compared with eager (graph_passes/prepare/random_switch.py, ortrain/fixed_draws.py)."""

from __future__ import annotations

import warnings

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.errors import VerificationError
from ortrain.core.names import DROPOUT_SWITCH_INPUT
from ortrain.fixed_draws import FixedDraws, fixed_u
from ortrain.graph_passes.prepare.random_switch import switch_random_draws, uncentred_draws


# ----------------------------------------------------------------------------- the pass
def _draws_model() -> ir.Model:
    """x -> four draws shaped as x (uniform, normal, Bernoulli of x) and one of a fixed
    shape, each an output."""
    x = ir.Value(name="x", shape=ir.Shape([3, 5]), type=ir.TensorType(ir.DataType.FLOAT))
    nodes = [
        ir.node("RandomUniformLike", [x], {"low": -2.0, "high": 3.0}, num_outputs=1),
        ir.node("RandomNormalLike", [x], {"mean": 1.0, "scale": 0.5}, num_outputs=1),
        ir.node("Bernoulli", [x], num_outputs=1),
        ir.node("RandomUniform", [], {"shape": [2, 4], "dtype": 1}, num_outputs=1),
        ir.node("Multinomial", [x], {"sample_size": 2}, num_outputs=1),
    ]
    for k, n in enumerate(nodes):
        n.outputs[0].name = f"y{k}"
    graph = ir.Graph([x], [n.outputs[0] for n in nodes], nodes=nodes, opset_imports={"": 18})
    return ir.Model(graph, ir_version=9)


def _run(model: ir.Model, x: np.ndarray, on: bool) -> list[np.ndarray]:
    data = ir.serde.serialize_model(model).SerializeToString()
    sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x, DROPOUT_SWITCH_INPUT: np.asarray(on)})


def test_switched_draws_take_the_fixed_values_eager_takes_and_draw_when_on():
    model = _draws_model()
    assert sorted(uncentred_draws(model)) == [
        "Bernoulli", "Multinomial", "RandomNormalLike", "RandomUniform", "RandomUniformLike"
    ]  # fmt: skip
    assert switch_random_draws(model) == 4
    assert uncentred_draws(model) == ["Multinomial"]  # no fixed value: left to draw
    x = np.random.default_rng(0).uniform(0.0, 1.0, (3, 5)).astype(np.float32)
    uniform, normal, bern, shaped, _ = _run(model, x, on=False)
    u = fixed_u((3, 5))
    np.testing.assert_array_equal(uniform, (-2.0 + 5.0 * u).float().numpy())
    np.testing.assert_array_equal(normal, (1.0 + 0.5 * (2 * u - 1)).float().numpy())
    np.testing.assert_array_equal(bern, (u.float() < torch.from_numpy(x)).float().numpy())
    np.testing.assert_array_equal(shaped, fixed_u((2, 4)).float().numpy())
    assert len(np.unique(uniform)) == uniform.size  # distinct: a sort of them has no ties
    # eager's draws under the check's mode give the same values
    with FixedDraws() as mode:
        eager = torch.empty(3, 5).uniform_(-2.0, 3.0)
        eager_n = torch.empty(3, 5).normal_(1.0, 0.5)
        eager_b = torch.bernoulli(torch.from_numpy(x))
        eager_r = torch.rand(2, 4)
    assert mode.fixed == 4 and not mode.unverified
    for got, want in [(uniform, eager), (normal, eager_n), (bern, eager_b), (shaped, eager_r)]:
        np.testing.assert_array_equal(got, want.numpy())
    # the switch on: draws, in their ranges
    uniform, normal, bern, shaped, _ = _run(model, x, on=True)
    assert not np.array_equal(uniform, (-2.0 + 5.0 * u).float().numpy())
    assert uniform.min() >= -2.0 and uniform.max() <= 3.0 and set(np.unique(bern)) <= {0, 1}


def test_eager_draws_without_a_fixed_value_are_named():
    with FixedDraws() as mode:
        torch.empty(4).exponential_()  # has one
        torch.randperm(5)
        torch.multinomial(torch.ones(3), 2)
        torch.randint(0, 7, (6,))  # has one
    assert mode.unverified == {"randperm", "multinomial"} and mode.fixed == 2


def test_derived_draws_follow_torchs_own_decompositions_of_u():
    """exponential, log-normal, Cauchy, geometric: torch._refs' formulas over ``u``."""
    u = fixed_u((6,)).float()
    with FixedDraws() as mode:
        e = torch.empty(6).exponential_(2.0)
        e2 = torch.ops.aten.exponential(torch.empty(6), 2.0)
        ln = torch.empty(6).log_normal_(0.5, 0.3)
        c = torch.empty(6).cauchy_(0.1, 2.0)
        ge = torch.empty(6).geometric_(0.3)
    assert mode.fixed == 5 and not mode.unverified
    torch.testing.assert_close(e, -torch.log(u) / 2.0, rtol=0, atol=0)
    torch.testing.assert_close(e2, e, rtol=0, atol=0)
    torch.testing.assert_close(ln, torch.exp(0.3 * (2 * u - 1) + 0.5))
    torch.testing.assert_close(c, 0.1 + 2.0 * torch.tan(torch.pi * (u - 0.5)))
    torch.testing.assert_close(ge, torch.floor(torch.log1p(-u) / np.log1p(-0.3)) + 1)
    assert (e > 0).all() and (ge >= 1).all() and len(set(ge.tolist())) > 1


# ------------------------------------------------------------------------ the trainer
def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


class _Draws(torch.nn.Module):
    """A classifier whose training forward draws as ``kind`` says."""

    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)
        self.log_std = torch.nn.Parameter(torch.full((16,), -1.0))

    def forward(self, x, y):
        h = torch.tanh(self.a(x))
        k = self.kind
        if k == "reparameterised":  # a VAE's sample
            h = h + self.log_std.exp() * torch.randn_like(h)
        elif k == "normal":
            h = torch.normal(h, self.log_std.exp().expand_as(h))
        elif k == "drop_path":  # timm's: a whole sample dropped, the rest scaled
            keep = h.new_empty(h.shape[0], 1).bernoulli_(0.8)
            h = h * keep / 0.8
        elif k == "shuffle":  # MAE's: a random order of the features, kept half
            order = torch.argsort(torch.rand(h.shape, device=h.device), dim=-1)
            h = torch.gather(h, -1, order) * 2.0
        elif k == "noise_scale":  # uniform noise, scaled by a parameter
            h = h * (1 + self.log_std * (torch.rand_like(h) - 0.5))
        elif k == "gumbel":  # exponential_
            h = F.gumbel_softmax(h, tau=0.7)
        elif k == "gumbel_hard":  # straight-through: one-hot forward, soft backward
            h = h * F.gumbel_softmax(h, tau=0.5, hard=True) * 16
        elif k == "log_normal_cauchy":
            h = h * torch.empty_like(h).log_normal_(0.0, 0.2)
            h = h + 0.01 * torch.empty_like(h).cauchy_() * self.log_std
        elif k == "multinomial":  # no fixed value
            h = h + h.gather(-1, torch.multinomial(h.softmax(-1), 1))
        return F.cross_entropy(self.b(h), y)


@pytest.mark.parametrize(
    "kind",
    ["reparameterised", "drop_path", "shuffle", "noise_scale", "gumbel", "gumbel_hard",
     "log_normal_cauchy"],
)  # fmt: skip
def test_a_graph_that_draws_is_checked_against_eager(kind):
    model = _Draws(kind)
    options = TrainerOptions(fallback="off", graph_cache=False)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not checked against eager"
        losses = [trainer.train_step(*_batch(s)).item() for s in range(3)]
    assert trainer.segments is None and trainer.program.segments[0].checked == 1
    assert all(np.isfinite(losses))
    # it still draws while it trains: one batch twice, two losses
    x, y = _batch(7)
    assert trainer.train_step(x, y).item() != trainer.train_step(x, y).item()


def test_a_draw_eager_cannot_fix_leaves_the_step_trusted_with_a_warning():
    model = _Draws("multinomial")
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.warns(UserWarning, match=r"not checked against eager: .*[Mm]ultinomial"):
        trainer.train_step(*_batch())
    assert trainer.segments is None and trainer.program.segments[0].checked == 0


def _wider_uniform(monkeypatch) -> None:
    """A test-only exporter that changes a draw's meaning: ``rand_like`` translated as a
    uniform draw on [0, 2)."""
    import ortrain.export as export_mod

    def wider(self, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        from onnxscript import opset18 as op

        return op.RandomUniformLike(self, low=0.0, high=2.0)

    table = {torch.ops.aten.rand_like.default: wider}
    monkeypatch.setattr(export_mod, "loss_translations", lambda: table)


@pytest.mark.parametrize("fallback", ["off", "auto"])
def test_an_exporter_that_changes_a_draw_is_caught(monkeypatch, fallback):
    """Before draws were fixed this graph was trusted (with a warning) and trained with
    twice eager's noise."""
    _wider_uniform(monkeypatch)
    model = _Draws("noise_scale")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    options = TrainerOptions(fallback=fallback, graph_cache=False)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    if fallback == "off":
        with pytest.raises(VerificationError, match=r"disagrees with eager"):
            trainer.train_step(*_batch())
        for k, v in model.state_dict().items():  # nothing trained
            assert torch.equal(v, before[k]), k
    else:
        with pytest.warns(UserWarning, match=r"first step disagrees with eager"):
            trainer.train_step(*_batch())
        assert trainer.segments is not None  # the root, which draws, trains in eager


def test_torch_normal_has_no_gradient_in_eager_and_the_graph_is_caught_giving_one():
    """``torch.normal(mean, std)`` is not differentiable in eager (its derivative is zero
    for both); the exporter's translation, ``randn * std + mean``, is: before draws were
    fixed, the graph was trusted and trained ``a`` and ``log_std`` through the sample."""
    model = _Draws("normal")
    options = TrainerOptions(fallback="off", graph_cache=False)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    with pytest.raises(VerificationError, match=r"log_std"):
        trainer.train_step(*_batch())
    x, y = _batch()
    model.zero_grad()
    model(x, y).backward()  # eager: the sample passes no gradient back
    assert torch.count_nonzero(model.log_std.grad) == 0
    assert torch.count_nonzero(model.a.weight.grad) == 0
