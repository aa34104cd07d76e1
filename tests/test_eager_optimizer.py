"""Optimizers ortrain does not compile (``EagerUpdate``, ``ortrain/runtime/update_engines.py``):
the gradients come from the training graph, the optimizer's own ``step()`` runs in eager
PyTorch over ortrain's parameters. Each trains like eager PyTorch (losses per step, final
parameters) with an LR schedule, clipping and accumulation; its state round-trips through
the trainer's checkpoints; what cannot work with it (ZeRO, a compiled engine asked for)
says so."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
import transformers

from ortrain import ORTTrainer, TrainerOptions, UnsupportedOptimizerError
from ortrain.graph_passes.training.zero import check_shardable
from ortrain.loss_scaler import DynamicLossScale
from ortrain.optim.from_torch import optimizer_spec
from tests.unexportable import smoothed_cross_entropy

pytestmark = pytest.mark.shared_graphs  # many trainers of the same few models

ACCUM = 2
CLIP = 0.5


class _Tagger(torch.nn.Module):
    """An embedding, a LayerNorm'd hidden layer and a cross-entropy head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(20, 12)
        self.hidden = torch.nn.Linear(12, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.hidden(self.emb(ids))))
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class _ScaledAdamW(torch.optim.AdamW):
    """A subclass with its own step (a compiled AdamW update would never run it)."""

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(0.5)
        return super().step(closure)


def _adafactor(params) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    return transformers.optimization.Adafactor(
        params, lr=1e-2, relative_step=False, scale_parameter=False, warmup_init=False
    )


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "rmsprop-centered-momentum": lambda p: torch.optim.RMSprop(
        p, lr=1e-2, momentum=0.9, centered=True, weight_decay=0.01
    ),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01),
    "nadam": lambda p: torch.optim.NAdam(p, lr=1e-2),
    "radam": lambda p: torch.optim.RAdam(p, lr=1e-2),
    "adamax": lambda p: torch.optim.Adamax(p, lr=1e-2),
    "adamw-amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True),
    "adam-maximize": lambda p: torch.optim.Adam(p, lr=1e-3, maximize=True),
    "own-step": lambda p: _ScaledAdamW(p, lr=1e-2),
    "adafactor": _adafactor,
}


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        {
            "ids": torch.randint(0, 20, (4, 6), generator=g),
            "labels": torch.randint(0, 5, (4, 6), generator=g),
        }
        for _ in range(n)
    ]


def _eager(model: torch.nn.Module, opt, sched, batches) -> list[float]:  # type: ignore[no-untyped-def]
    """Eager PyTorch with the same accumulation, clipping and schedule."""
    losses = []
    for i, batch in enumerate(batches):
        loss = model(**batch)
        (loss / ACCUM).backward()
        losses.append(float(loss))
        if (i + 1) % ACCUM == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            sched.step()
    return losses


@pytest.mark.parametrize("which", sorted(OPTIMIZERS))
def test_trains_like_eager(which):
    make = OPTIMIZERS[which]
    model = _Tagger()
    ref = copy.deepcopy(model)
    opt, opt_ref = make(model.parameters()), make(ref.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    sched_ref = torch.optim.lr_scheduler.StepLR(opt_ref, step_size=2, gamma=0.5)
    options = TrainerOptions(grad_accumulation_steps=ACCUM, max_grad_norm=CLIP)
    with pytest.warns(UserWarning, match=r"update runs as its own step\(\) in eager PyTorch"):
        trainer = ORTTrainer(model, opt, options)
    assert trainer.spec.kind == "eager"
    batches = _batches(8)
    losses = []
    for i, batch in enumerate(batches):
        losses.append(float(trainer.train_step(**batch)))
        if (i + 1) % ACCUM == 0:
            sched.step()
    expected = _eager(ref, opt_ref, sched_ref, batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    assert trainer.program.update == "eager" and trainer.build_count == 1
    assert trainer.last_grad_norm is not None and trainer.last_grad_norm > CLIP  # clipped
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        moved = (p - _Tagger().state_dict()[name]).abs().max()
        assert moved > 1e-4, name  # trained: not a comparison of initial weights
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert trainer.state_bytes().optimizer_state > 0  # the optimizer's own state, counted


class _SmoothedTagger(_Tagger):
    """Its loss has no ONNX function: it trains as compiled segments."""

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.hidden(self.emb(ids))))
        return smoothed_cross_entropy(self.head(h).flatten(0, 1), labels.flatten(), 0.1)


def test_segmented_model_trains_like_eager():
    """The gradients from torch's backward through the segments feed the optimizer's own
    step as the whole graph's do."""
    model = _SmoothedTagger()
    ref = copy.deepcopy(model)
    make = OPTIMIZERS["nadam"]
    opt_ref = make(ref.parameters())
    with pytest.warns(UserWarning, match="eager PyTorch"):
        trainer = ORTTrainer(model, make(model.parameters()), TrainerOptions(max_grad_norm=CLIP))
    batches = _batches(4)
    losses = [float(trainer.train_step(**b)) for b in batches]
    assert trainer.segments is not None and trainer.segments.model is not None
    expected = []
    for b in batches:
        loss = ref(**b)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt_ref.step()
        opt_ref.zero_grad()
        expected.append(float(loss))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_checkpoint_resumes_the_optimizers_own_state(tmp_path):
    """Its state dict is the optimizer's own (torch's format); a new trainer that loads it
    continues exactly as the uninterrupted run."""
    batches = _batches(8)
    make = OPTIMIZERS["rmsprop-centered-momentum"]

    def trainer_of(model: torch.nn.Module) -> ORTTrainer:
        with pytest.warns(UserWarning, match="eager PyTorch"):
            return ORTTrainer(model, make(model.parameters()), TrainerOptions(max_grad_norm=CLIP))

    whole = trainer_of(_Tagger())
    straight = [float(whole.train_step(**b)) for b in batches]
    first = trainer_of(_Tagger())
    head = [float(first.train_step(**b)) for b in batches[:4]]
    first.save_checkpoint(tmp_path / "ckpt.pt")
    saved = first.state_dict()
    assert set(saved["optimizer"]["state"][0]) >= {"square_avg", "momentum_buffer", "grad_avg"}
    second = trainer_of(_Tagger())
    second.load_checkpoint(tmp_path / "ckpt.pt")
    tail = [float(second.train_step(**b)) for b in batches[4:]]
    assert head + tail == straight
    for (name, p), q in zip(
        second.module.named_parameters(), whole.module.parameters(), strict=True
    ):
        assert torch.equal(p, q), name


def test_what_cannot_run_it_says_so():
    model = _Tagger()
    for opt, why in (
        (torch.optim.LBFGS(model.parameters()), "closure"),
        (torch.optim.SparseAdam(list(model.emb.parameters())), "sparse gradients"),
    ):
        with pytest.raises(UnsupportedOptimizerError, match=why):
            ORTTrainer(model, opt)
    names = {id(p): n for n, p in model.named_parameters()}
    spec = optimizer_spec(torch.optim.RMSprop(model.parameters()), names)
    assert spec.kind == "eager" and spec.source == "torch.optim.rmsprop.RMSprop"
    with pytest.raises(UnsupportedOptimizerError, match=r"ZeRO .*RMSprop keeps its own"):
        check_shardable(spec)
    with pytest.warns(UserWarning, match="eager"):
        with pytest.raises(UnsupportedOptimizerError, match=r"update_engine=.graph.*eager PyTorch"):
            ORTTrainer(
                model,
                torch.optim.RMSprop(model.parameters()),
                TrainerOptions(update_engine="graph"),
            )


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop])
def test_sparse_gradients_an_eager_step_refuses_are_refused(cls):
    """An ``Embedding(sparse=True)``: eager's Adam, AdamW, RMSprop... raise on its sparse
    gradient at their first step; ortrain's gradients are dense, so it trained on where
    eager stops. Refused at construction, naming the module; SGD and Adagrad (whose eager
    steps take sparse gradients, to the same update as dense ones) train."""
    model = _Tagger()
    model.emb.sparse = True
    x = torch.randint(0, 10, (2, 5))
    with pytest.raises(RuntimeError, match="sparse"):  # eager's own refusal
        eager = copy.deepcopy(model)
        opt = cls(eager.parameters())
        eager.emb(x).sum().backward()
        opt.step()
    with pytest.raises(UnsupportedOptimizerError, match=rf"{cls.__name__} .*emb \(sparse=True\)"):
        ORTTrainer(model, cls(model.parameters()))
    for ok in (torch.optim.SGD, torch.optim.Adagrad):
        ORTTrainer(model, ok(model.parameters(), lr=0.1))


def test_loss_scaling_skips_an_overflowing_update_before_the_optimizer_sees_it():
    """fp16 with a loss scale that overflows at first: those windows change nothing (the
    optimizer's step is not called, its state stays empty) and are not counted; once the
    scale has backed off, the optimizer's own step trains."""
    model = _Tagger()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-2)
    options = TrainerOptions(
        mixed_precision="fp16", loss_scale=DynamicLossScale(initial=2.0**40, factor=2.0**8)
    )
    with pytest.warns(UserWarning, match="eager PyTorch"):
        trainer = ORTTrainer(model, opt, options)
    batches = _batches(8)
    trainer.train_step(**batches[0])
    assert trainer.skipped_steps == 1 and trainer.step == 0 and not opt.state
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    losses = [float(trainer.train_step(**b)) for b in batches[1:]]
    assert trainer.step > 0 and trainer.step + trainer.skipped_steps == len(batches)
    assert all(math.isfinite(v) for v in losses) and len(opt.state) == len(before)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
