"""The optimizer update through the fused kernels (``update_engine="kernels"``) instead of
the update graph: on CPU the kernels' CPU reference library runs, so the trainer's whole
kernel path (flat groups, LAMB segments, clipping, loss-scale skip) is checked here; on a
GPU the same path runs the CUDA library."""

from __future__ import annotations

import copy

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions, UnsupportedOptimizerError
from ortrain.loss_scaler import DynamicLossScale
from ortrain.optim import Lamb
from tests.conftest import bert_batches, bert_mlm, decay_groups, gpt2, lm_batches
from tests.test_parity import _check

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def adamw(m):
    return torch.optim.AdamW(decay_groups(m, 0.01), lr=2e-3, betas=(0.9, 0.98), eps=1e-6)


def adam(m):
    return torch.optim.Adam(decay_groups(m, 0.01), lr=1e-3)


def lamb(m):
    return Lamb(decay_groups(m, 0.01), lr=5e-3)


@pytest.mark.parametrize("make_opt", [adamw, adam, lamb], ids=["adamw", "adam", "lamb"])
def test_kernel_update_matches_eager(make_opt):
    options = TrainerOptions(update_engine="kernels", max_grad_norm=0.5)
    trainer = _check(
        lambda: gpt2(layers=2, hidden=64, vocab=256), make_opt, lm_batches(8, vocab=256), options
    )
    assert trainer._fused is not None and trainer.update_graph is None  # no update graph
    assert trainer.last_grad_norm > 0.5  # clipping was active


def test_kernel_update_with_accumulation_on_bert():
    options = TrainerOptions(update_engine="kernels", grad_accumulation_steps=2)
    _check(lambda: bert_mlm(vocab=256, hidden=64), adamw, bert_batches(6, vocab=256), options)


def test_kernel_update_equals_graph_update():
    base = gpt2(layers=1, hidden=64, vocab=128)
    batches = lm_batches(5, vocab=128)
    out = {}
    for engine in ("graph", "kernels"):
        model = copy.deepcopy(base)
        opts = TrainerOptions(update_engine=engine, max_grad_norm=1.0, loss_scale=256.0)
        trainer = ORTTrainer(model, adamw(model), opts)
        out[engine] = ([trainer.train_step(**b).item() for b in batches], trainer)
    (lg, tg), (lk, tk) = out["graph"], out["kernels"]
    torch.testing.assert_close(torch.tensor(lk), torch.tensor(lg), rtol=1e-6, atol=0)
    for name, p in tg.params.items():
        torch.testing.assert_close(tk.params[name], p, rtol=1e-5, atol=1e-7)
    assert tk.step == tg.step == 5


def test_kernel_update_skips_overflow_bit_identically():
    model = gpt2(layers=1, hidden=64, vocab=128)
    opts = TrainerOptions(
        update_engine="kernels", loss_scale=DynamicLossScale(initial=2.0**100, window=2)
    )
    trainer = ORTTrainer(model, adamw(model), opts)
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


def test_kernels_reject_sgd_clearly():
    model = gpt2(layers=1, hidden=64, vocab=128)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(UnsupportedOptimizerError, match="update_engine"):
        ORTTrainer(model, opt, TrainerOptions(update_engine="kernels"))
    with pytest.raises(ValueError, match="update_engine"):
        TrainerOptions(update_engine="fast")


def test_missing_kernel_library_is_named(monkeypatch, tmp_path):
    from ortrain.runtime import kernels

    monkeypatch.setenv("ORTRAIN_KERNELS_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "search_dirs", lambda: [tmp_path])
    model = gpt2(layers=1, hidden=64, vocab=128)
    with pytest.raises(kernels.KernelLibraryError, match="libortrain_kernels_cpu"):
        ORTTrainer(model, adamw(model), TrainerOptions(update_engine="kernels"))
