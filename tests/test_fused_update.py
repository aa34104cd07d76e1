"""The optimizer update through the fused kernels (``update_engine="kernels"``) instead of
the update graph: on CPU the kernels' CPU reference library runs, so the trainer's whole
kernel path (flat groups, LAMB segments, clipping, loss-scale skip) is checked here; on a
GPU the same path runs the CUDA library."""

from __future__ import annotations

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions, UnsupportedOptimizerError
from ortrain.optim import Lamb
from tests.conftest import bert_batches, bert_mlm, decay_groups, gpt2, lm_batches
from tests.test_parity import _check
from tests.update_engines import assert_engines_agree, assert_overflow_changes_nothing

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def adamw(m):
    return torch.optim.AdamW(decay_groups(m, 0.01), lr=2e-3, betas=(0.9, 0.98), eps=1e-6)


def adam(m):
    return torch.optim.Adam(decay_groups(m, 0.01), lr=1e-3)


def lamb(m):
    return Lamb(decay_groups(m, 0.01), lr=5e-3)


@pytest.mark.slow
@pytest.mark.parametrize("make_opt", [adamw, adam, lamb], ids=["adamw", "adam", "lamb"])
def test_kernel_update_matches_eager(make_opt):
    options = TrainerOptions(update_engine="kernels", max_grad_norm=0.5)
    trainer = _check(
        lambda: gpt2(layers=2, hidden=64, vocab=256), make_opt, lm_batches(8, vocab=256), options
    )
    assert trainer.update_engine.name == "kernels" and trainer.update_graph is None
    assert trainer.last_grad_norm > 0.5  # clipping was active


@pytest.mark.slow
def test_kernel_update_with_accumulation_on_bert():
    options = TrainerOptions(update_engine="kernels", grad_accumulation_steps=2)
    _check(lambda: bert_mlm(vocab=256, hidden=64), adamw, bert_batches(6, vocab=256), options)


@pytest.mark.slow
def test_kernel_update_equals_graph_update():
    assert_engines_agree("kernels", adamw)


@pytest.mark.slow
def test_kernel_update_skips_overflow_bit_identically():
    assert_overflow_changes_nothing("kernels", adamw)


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
