"""Parameters other than float32 (``ortrain/param_dtypes.py``): a model in float64 or with
bfloat16 weights trains as eager would, the modules holding them in eager PyTorch and the
update the optimizer's own; float32 sub-modules beside them still compile; where only
compiled graphs may hold them (fallback "off", mixed precision) the trainer refuses,
naming the parameter."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from ortrain import ORTTrainer, ParameterDtypeError, TrainerOptions


def _mlp(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.LayerNorm(12), torch.nn.Linear(12, 3)
    ).to(dtype)


class _Float64Head(torch.nn.Module):
    """A float32 body (compiles) and a float64 head (eager), its loss in float64."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.body = torch.nn.Sequential(
            torch.nn.Linear(8, 24), torch.nn.Tanh(), torch.nn.Linear(24, 16)
        )
        self.head = torch.nn.Linear(16, 4).double()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.head(self.body(x).double()), y)


def _mse(out: torch.Tensor, batch: dict) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, batch["y"])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_model_of_another_dtype_trains_as_eager_does(dtype: torch.dtype) -> None:
    model, ref = _mlp(dtype), _mlp(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    options = TrainerOptions(grad_accumulation_steps=2, max_grad_norm=0.3)
    with pytest.warns(UserWarning, match=rf"parameter 0\.weight is {dtype}") as caught:
        trainer = ORTTrainer(model, opt, options, loss_fn=_mse)
        g = torch.Generator().manual_seed(2)
        for i in range(6):
            x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
            x, y = x.to(dtype), y.to(dtype)
            got = trainer.train_step(x, y=y)
            want = _mse(ref(x), {"y": y})
            (want / 2).backward()
            if i % 2 == 1:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
                ref_opt.step()
                ref_opt.zero_grad()
            assert got.dtype == dtype  # the loss as eager's, not rounded to float32
            assert torch.equal(got, want.detach()), (i, got, want)
    assert sum("update runs as its own step()" in str(w.message) for w in caught) == 0
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.dtype == dtype
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    assert trainer.step == 3
    program = trainer.program
    assert program.update == "eager"
    assert {s.kind for s in program.segments} == {"eager"}
    assert all(str(dtype) in s.cause for s in program.segments)


def test_float32_modules_beside_them_still_compile() -> None:
    model = _Float64Head()
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = ORTTrainer(model, opt)
        g = torch.Generator().manual_seed(3)
        for i in range(4):
            x, y = torch.randn(7, 8, generator=g), torch.randint(0, 4, (7,), generator=g)
            got = trainer.train_step(x, y)
            want = ref(x, y)
            want.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            assert got.dtype == torch.float64
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0, msg=f"step {i}")
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    kinds = {s.module: s.kind for s in trainer.program.segments}
    assert kinds == {"body": "compiled", "head": "eager"}


def test_a_bfloat16_transformer_trains_as_eager_does() -> None:
    cfg = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=16, embd_pdrop=0.0,
        resid_pdrop=0.1, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    model.train()
    ref.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = ORTTrainer(model, opt)
        g = torch.Generator().manual_seed(4)
        for i in range(3):
            ids = torch.randint(0, 96, (2, 16), generator=g)
            torch.manual_seed(100 + i)  # the same dropout draws
            got = trainer.train_step(input_ids=ids, labels=ids)
            torch.manual_seed(100 + i)
            want = ref(input_ids=ids, labels=ids).loss
            want.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            assert torch.equal(got, want.detach()), (i, got, want)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_refused_where_only_compiled_graphs_may_hold_them() -> None:
    model = _mlp(torch.float64)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ParameterDtypeError, match=r"0\.weight is torch\.float64.*fallback='off'"):
        ORTTrainer(model, opt, TrainerOptions(fallback="off"), loss_fn=_mse)
    with pytest.raises(ParameterDtypeError, match=r"0\.weight is torch\.float64.*mixed_precision"):
        ORTTrainer(model, opt, TrainerOptions(mixed_precision="fp16"), loss_fn=_mse)
    with pytest.raises(TypeError):  # the refusal a caller catching TypeError still sees
        ORTTrainer(model, opt, TrainerOptions(fallback="off"), loss_fn=_mse)


def test_the_hf_trainer_trains_a_bfloat16_model_as_trainer_does(tmp_path) -> None:
    from transformers import Trainer

    from ortrain.hf_trainer import ORTHFTrainer
    from tests.conftest import gpt2
    from tests.test_hf_trainer import VOCAB, TokenData, gpt2_arguments, steps

    runs = {}
    for name, cls in (("torch", Trainer), ("ortrain", ORTHFTrainer)):
        model = gpt2(layers=2, hidden=32, vocab=VOCAB, seed=0).to(torch.bfloat16)
        trainer = cls(
            model=model,
            args=gpt2_arguments(tmp_path / name),  # accumulation, clipping, a schedule
            train_dataset=TokenData(44, seed=3),
            eval_dataset=TokenData(8, seed=4),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
            runs[name] = (trainer, steps(trainer), trainer.evaluate()["eval_loss"])
    (want, want_logs, want_eval), (got, got_logs, got_eval) = runs["torch"], runs["ortrain"]
    assert len(got_logs) == len(want_logs) == 6
    for g, w in zip(got_logs, want_logs, strict=True):
        assert (g["loss"], g["grad_norm"], g["learning_rate"]) == (
            w["loss"],
            w["grad_norm"],
            w["learning_rate"],
        )
    assert got_eval == want_eval
    for (name, p), q in zip(got.model.named_parameters(), want.model.parameters(), strict=True):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q), name
