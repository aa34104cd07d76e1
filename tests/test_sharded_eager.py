"""Which optimizers ortrain does not compile run their own step on ZeRO's shard pieces
(``ortrain/optim/sharded_eager.py``), with what state, and which are refused, naming why.
Training under ZeRO with them: ``tests/test_distributed.py::
test_zero_runs_an_elementwise_optimizer_s_own_step_on_its_shard``."""

from __future__ import annotations

import pytest
import torch
import transformers

from ortrain import UnsupportedOptimizerError
from ortrain.core.optimizer_spec import SHARDED_EAGER
from ortrain.optim.from_torch import check_groups, optimizer_spec
from ortrain.optim.sharded_eager import changed_flags, make_like, sharded_eager_spec
from ortrain.runtime.update_engines import ENGINES, EngineFacts, choose_engine


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.LayerNorm(5))


def _spec(opt: torch.optim.Optimizer, model: torch.nn.Module):
    names = {id(p): n for n, p in model.named_parameters()}
    return sharded_eager_spec(optimizer_spec(opt, names), opt)


@pytest.mark.parametrize(
    ("make", "state", "stepped", "scalars"),
    [
        (
            lambda ps: torch.optim.NAdam(ps, decoupled_weight_decay=True, weight_decay=0.1),
            {"exp_avg", "exp_avg_sq"},
            True,
            ("mu_product",),
        ),
        (lambda ps: torch.optim.ASGD(ps, t0=2), {"ax"}, True, ("eta", "mu")),
        (
            lambda ps: torch.optim.RMSprop(ps, momentum=0.9, centered=True),
            {"square_avg", "momentum_buffer", "grad_avg"},
            True,
            (),
        ),
        (lambda ps: torch.optim.RMSprop(ps), {"square_avg"}, True, ()),
        (
            lambda ps: torch.optim.Adam(ps, amsgrad=True),
            {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
            True,
            (),
        ),
        (lambda ps: torch.optim.Adagrad(ps, lr_decay=0.1), {"sum"}, True, ()),
        (lambda ps: torch.optim.Rprop(ps), {"prev", "step_size"}, True, ()),
        (lambda ps: torch.optim.Adadelta(ps), {"square_avg", "acc_delta"}, True, ()),
        (lambda ps: torch.optim.Adamax(ps), {"exp_avg", "exp_inf"}, True, ()),
        (
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, maximize=True),
            {"momentum_buffer"},
            False,
            (),
        ),
    ],
)
def test_elementwise_optimizers_keep_their_state_per_element(make, state, stepped, scalars):
    model = _model()
    opt = make(model.parameters())
    spec = _spec(opt, model)
    assert spec.kind == SHARDED_EAGER
    assert set(spec.state) == state and len(spec.state) == len(state)
    assert spec.stepped is stepped and spec.counts_steps is stepped
    assert spec.scalars == scalars  # numbers per parameter only its steps change
    assert spec.hyperparameters == ()  # its own step reads its param groups
    assert all(spec.state_names(g) == spec.state for g in spec.groups)
    # the probe stepped an optimizer of its own (Adagrad makes its state when made)
    assert all(float(e.get("step", 0)) == 0 for e in opt.state.values())


def test_a_copy_over_pieces_steps_as_the_optimizer_on_whole_tensors():
    """What the engine relies on: the class's step on pieces of a tensor (leaf views of
    it, gradient pieces) writes what its step on the whole tensor writes."""
    torch.manual_seed(1)
    whole = torch.randn(10, requires_grad=True)
    flat = whole.detach().clone()
    grads = [torch.randn(10) for _ in range(3)]
    opt = torch.optim.RMSprop([whole], lr=0.01, momentum=0.9, centered=True)
    pieces = [flat[:3].detach().requires_grad_(), flat[3:].detach().requires_grad_()]
    mine = make_like(opt, [pieces])
    assert type(mine) is torch.optim.RMSprop and mine.param_groups[0]["centered"]
    for g in grads:
        whole.grad = g.clone()
        opt.step()
        pieces[0].grad, pieces[1].grad = g[:3].clone(), g[3:].clone()
        mine.step()
    torch.testing.assert_close(flat, whole.detach(), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (
            lambda ps: transformers.optimization.Adafactor(ps, lr=1e-3, relative_step=False),
            r"Adafactor runs its own step\(\).*element by element",
        ),
    ],
)
def test_what_is_not_elementwise_is_refused_naming_why(make, why):
    model = _model()
    with pytest.raises(UnsupportedOptimizerError, match=why):
        _spec(make(model.parameters()), model)


def test_a_subclass_with_its_own_step_is_refused():
    class Clipped(torch.optim.RMSprop):
        def step(self, closure=None):  # type: ignore[override]
            for g in self.param_groups:  # a whole-tensor rule: a piece would clip alone
                torch.nn.utils.clip_grad_norm_(g["params"], 1.0)
            return super().step(closure)

    model = _model()
    with pytest.raises(UnsupportedOptimizerError, match=r"Clipped runs its own step\(\)"):
        _spec(Clipped(model.parameters()), model)


def test_a_flag_that_changes_the_state_is_refused_after_the_trainer_is_made():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, amsgrad=True)
    spec = _spec(opt, model)
    opt.param_groups[0]["lr"] = 5e-4  # numbers may change (schedulers)
    assert changed_flags(opt, spec) == []
    check_groups(opt, spec)
    opt.param_groups[0]["amsgrad"] = False
    assert changed_flags(opt, spec) == ["group 0 amsgrad"]
    with pytest.raises(UnsupportedOptimizerError, match="group 0 amsgrad changed after"):
        check_groups(opt, spec)


def test_the_engine_is_zero_eager_and_refuses_another():
    assert ENGINES["zero-eager"].name == "zero-eager"
    facts = EngineFacts(
        requested="auto",
        device=torch.device("cpu"),
        kind=SHARDED_EAGER,
        zero_stage=2,
        cpu_kernels=True,
        accumulation=1,
        clipping=False,
        fp32=True,
    )
    assert choose_engine(facts) == "zero-eager"
    import dataclasses

    with pytest.raises(UnsupportedOptimizerError, match="own step"):
        choose_engine(dataclasses.replace(facts, requested="torch"))
