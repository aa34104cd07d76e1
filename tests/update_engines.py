"""Checks shared by the tests of the update engines (``update_engine=...``): two engines
trained side by side must agree element by element, and an overflowing step must change
nothing, bit for bit."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions
from ortrain.loss_scaler import DynamicLossScale
from tests.conftest import gpt2, lm_batches
from tests.test_parity import drop_key_bias

MakeOpt = Callable[[torch.nn.Module], torch.optim.Optimizer]


def assert_engines_agree(engine: str, make_opt: MakeOpt, reference: str = "graph") -> None:
    """5 steps of a 1-layer GPT-2 with a loss scale of 256 and clipping on ``engine`` and
    on ``reference``: losses, parameters, moments, step count and gradient norm agree."""
    base = gpt2(layers=1, hidden=64, vocab=128)
    batches = lm_batches(5, vocab=128)
    out = {}
    for name in (reference, engine):
        model = copy.deepcopy(base)
        opts = TrainerOptions(update_engine=name, max_grad_norm=1.0, loss_scale=256.0)
        trainer = ORTTrainer(model, make_opt(model), opts)
        out[name] = [trainer.train_step(**b).item() for b in batches], trainer
    (lr, tr), (le, te) = out[reference], out[engine]
    torch.testing.assert_close(torch.tensor(le), torch.tensor(lr), rtol=1e-6, atol=0)
    for name, p in tr.params.items():
        # The key bias's true gradient is 0 (softmax ignores a per-row shift): what Adam
        # makes of its rounding noise is left out, as in the eager parity tests.
        q, p = drop_key_bias(name, te.params[name], base), drop_key_bias(name, p, base)
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7)
    for key, s in tr.opt_state.items():  # moments: absolute error on the tensor's scale
        scale = float(s.abs().max())
        torch.testing.assert_close(te.opt_state[key], s, rtol=1e-5, atol=1e-6 * scale)
    assert te.step == tr.step == 5
    assert te.last_grad_norm == pytest.approx(tr.last_grad_norm, rel=1e-5)


def assert_overflow_changes_nothing(engine: str, make_opt: MakeOpt) -> None:
    """A loss scale of 2^100 overflows: two steps are skipped, parameters and moments
    stay bit-identical, the scale halves per skip; once it is small enough updates are
    applied and counted."""
    model = gpt2(layers=1, hidden=64, vocab=128)
    opts = TrainerOptions(
        update_engine=engine, loss_scale=DynamicLossScale(initial=2.0**100, window=2)
    )
    trainer = ORTTrainer(model, make_opt(model), opts)
    batches = lm_batches(3, vocab=128)
    trainer.train_step(**batches[0])  # builds; overflows
    before = {k: v.clone() for k, v in trainer.params.items()}
    states = {k: v.clone() for k, v in trainer.opt_state.items()}
    trainer.train_step(**batches[1])
    assert trainer.skipped_steps == 2 and trainer.step == 0
    assert trainer.loss_scale == 2.0**98
    for k, v in trainer.params.items():
        assert torch.equal(v, before[k])
    for k, v in trainer.opt_state.items():
        assert torch.equal(v, states[k])
    while trainer.step == 0:
        trainer.train_step(**batches[2])
    assert any(not torch.equal(v, before[k]) for k, v in trainer.params.items())
