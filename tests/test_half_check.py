"""A mixed-precision graph's first-step check (``ortrain/verify.py``, ``HALF_FACTOR``):
where half precision itself moves the gradients beyond the tolerance (T5's attention has
no 1/sqrt(d) scale), eager under ``torch.autocast`` decides; a wrong rule is still caught
in the same model."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.errors import VerificationError
from ortrain.verify import Tolerance


def _t5() -> torch.nn.Module:
    import transformers
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        decoder_start_token_id=0, dropout_rate=0.0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 128, (4, 12), generator=g)
        out.append({"input_ids": ids, "labels": ids[:, :7].clone()})
    return out


def _grads(model: torch.nn.Module, batch: dict, half: bool) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.float16, enabled=half):
        loss = model(**batch).loss
    loss.backward()
    return {n: p.grad.double() for n, p in model.named_parameters()}


@pytest.mark.slow  # four steps of two trainers
def test_half_precision_noise_beyond_the_tolerance_is_eagers_too() -> None:
    base = _t5()
    batches = _batches(4)
    # the premise: fp16 in eager is itself further from fp32 than the tolerance
    exact, half = _grads(base, batches[0], False), _grads(base, batches[0], True)
    worst = max(float((half[n] - e).norm() / e.norm()) for n, e in exact.items() if e.norm())
    assert worst > 1.5 * Tolerance.of("fp16").grad, worst

    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    options = TrainerOptions(mixed_precision="fp16", graph_cache=False)
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in batches:
            opt_ref.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                want = ref(**batch).loss
            want.backward()
            opt_ref.step()
            got = trainer.train_step(**batch)
            torch.testing.assert_close(got, want.detach().float(), rtol=2e-3, atol=0)
    # one graph, checked: no fallback to segments for what autocast rounds alike
    assert trainer.segments is None
    assert not [w for w in caught if "does not compile as one graph" in str(w.message)]
    assert trainer.program.segments[0].checked == 1


def _wrong_relu_rule(monkeypatch) -> None:
    """A test-only Relu rule: ``1.5 dy`` where ``x > 0`` (T5's feed-forward is a ReLU)."""
    from ortrain.graph_passes.autodiff import registry

    (right,) = registry._TABLE[("", "Relu")]

    def wrong(ctx):
        x = ctx.I(0)
        zero = ctx.scalar_like(0.0, x)
        dy = ctx.op("Mul", ctx.GO(0), ctx.scalar_like(1.5, x))
        on = ctx.op("Greater", x, zero, dtype=None)
        return {0: ctx.op("Where", on, dy, zero, dtype=x.dtype)}

    monkeypatch.setitem(registry._TABLE, ("", "Relu"), [dataclasses.replace(right, fn=wrong)])


def test_a_wrong_rule_is_still_caught_in_half_precision(monkeypatch) -> None:
    _wrong_relu_rule(monkeypatch)
    model = _t5()
    options = TrainerOptions(mixed_precision="fp16", graph_cache=False, fallback="off")
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), options)
    with pytest.raises(VerificationError) as err:
        trainer.train_step(**_batches(1)[0])
    # the weights before a ReLU: their gradient is 1.5 times too large
    assert "DenseReluDense.wi.weight" in str(err.value)
