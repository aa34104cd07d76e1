"""Adam/AdamW updates through torch's fused kernels (``update_engine="torch"``, the CPU
default): equal to eager torch and to the update graph, element by element, with
clipping, accumulation, loss scaling and overflow skips."""

from __future__ import annotations

import copy

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions, UnsupportedOptimizerError
from ortrain.optim import Lamb
from tests.conftest import bert_batches, bert_mlm, decay_groups, gpt2, lm_batches
from tests.test_parity import _check
from tests.update_engines import assert_engines_agree, assert_overflow_changes_nothing

pytestmark = pytest.mark.shared_graphs  # many trainers of the same few models


def adamw(m):
    return torch.optim.AdamW(decay_groups(m, 0.01), lr=2e-3, betas=(0.9, 0.98), eps=1e-6)


def adam_l2(m):
    return torch.optim.Adam(decay_groups(m, 0.05), lr=1e-3, betas=(0.8, 0.99), eps=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["auto", "torch"])
def test_cpu_default_is_torch_fused_and_matches_eager(engine):
    options = TrainerOptions(update_engine=engine, max_grad_norm=0.5)
    trainer = _check(
        lambda: gpt2(layers=2, hidden=64, vocab=256), adamw, lm_batches(8, vocab=256), options
    )
    assert trainer.update_engine.name == "torch" and trainer.update_graph is None
    assert trainer.last_grad_norm > 0.5  # clipping was active
    # Gradients are views of one flat buffer, each moment of one per param group; the
    # kernels take the parameters where they are.
    grad_bases = {g._base.data_ptr() for g in trainer.grads.values() if g._base is not None}
    state_bases = {s._base.data_ptr() for s in trainer.opt_state.values() if s._base is not None}
    assert len(grad_bases) == 1 and len(trainer.grads) == len(trainer.params)
    groups = len(trainer.optimizer.param_groups)
    assert len(state_bases) == 2 * groups and len(trainer.opt_state) == 2 * len(trainer.params)


def test_parameters_stay_where_the_module_has_them():
    """The torch engine updates the module's own parameter tensors: no second copy of the
    model (which would leave the old storage to the allocator), and references a user
    took to ``param.data`` before training see the trained values."""
    model = gpt2(layers=2, hidden=64, vocab=256)
    before = {n: p.data for n, p in model.named_parameters()}
    ptrs = {n: t.data_ptr() for n, t in before.items()}
    trainer = ORTTrainer(model, adamw(model), TrainerOptions(update_engine="torch"))
    initial = {n: t.clone() for n, t in before.items()}
    for batch in lm_batches(2, vocab=256):
        trainer.train_step(**batch)
    assert trainer.update_engine.name == "torch"
    for n, p in model.named_parameters():
        assert p.data_ptr() == ptrs[n] == trainer.params[n].data_ptr(), n
        assert not torch.equal(before[n], initial[n]), f"{n} was not updated in place"


@pytest.mark.slow
def test_adam_l2_with_accumulation_on_bert():
    options = TrainerOptions(update_engine="torch", grad_accumulation_steps=2)
    _check(lambda: bert_mlm(vocab=256, hidden=64), adam_l2, bert_batches(6, vocab=256), options)


@pytest.mark.slow
@pytest.mark.parametrize("make_opt", [adamw, adam_l2], ids=["adamw", "adam"])
def test_torch_update_equals_graph_update(make_opt):
    assert_engines_agree("torch", make_opt)


def test_overflow_changes_nothing_bit_for_bit():
    assert_overflow_changes_nothing("torch", adamw)


def test_non_transformer_regressor_with_frozen_layer():
    """A model no issue names: an MLP regressor with a custom loss, one frozen layer and
    two param groups (different betas), AdamW with clipping, against eager."""

    class Regressor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(12, 48)
            self.norm = torch.nn.LayerNorm(48)
            self.head = torch.nn.Linear(48, 3)

        def forward(self, x):
            return self.head(torch.nn.functional.gelu(self.norm(self.embed(x))))

    def loss_fn(out, batch):
        return torch.nn.functional.smooth_l1_loss(out, batch["y"])

    def make_opt(m):
        return torch.optim.AdamW(
            [
                {"params": m.norm.parameters(), "weight_decay": 0.0, "betas": (0.5, 0.9)},
                {"params": m.head.parameters(), "lr": 3e-2},
            ],
            lr=1e-2,
            weight_decay=0.1,
        )

    torch.manual_seed(0)
    ref = Regressor()
    ref.embed.requires_grad_(False)
    model = copy.deepcopy(ref)
    opt_ref = make_opt(ref)
    trainer = ORTTrainer(model, make_opt(model), TrainerOptions(max_grad_norm=0.3), loss_fn=loss_fn)
    g = torch.Generator().manual_seed(3)
    for _ in range(8):
        x, y = torch.randn(64, 12, generator=g), torch.randn(64, 3, generator=g)
        opt_ref.zero_grad()
        loss = loss_fn(ref(x), {"y": y})
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
        opt_ref.step()
        ours = trainer.train_step(x, y=y)
        assert ours.item() == pytest.approx(loss.item(), rel=1e-5)
        assert trainer.last_grad_norm == pytest.approx(norm.item(), rel=1e-5)
    assert trainer.update_engine.name == "torch"
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_other_optimizers_keep_the_update_graph_and_torch_names_what_it_runs():
    model = gpt2(layers=1, hidden=64, vocab=128)
    trainer = ORTTrainer(model, Lamb(model.parameters(), lr=1e-3))
    trainer.train_step(**lm_batches(1, vocab=128)[0])
    assert trainer.update_engine.name == "graph" and trainer.update_graph is not None  # auto
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(UnsupportedOptimizerError, match="update_engine='torch' supports adam"):
        ORTTrainer(model, sgd, TrainerOptions(update_engine="torch"))  # at construction
