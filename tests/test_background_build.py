"""Graphs built in the background while the steps run in eager (``background_build``):
every step equal to eager PyTorch's, across the switches from eager to a graph and back
(a new length while a graph exists), with the optimizer state continuous between them."""

from __future__ import annotations

import copy

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions, explain
from ortrain.eager_steps import EagerSteps
from tests.adam_noise import NOISE_FLOOR
from tests.conftest import gpt2

LOSS_RTOL = 1e-5
_BACKGROUND = TrainerOptions(background_build=True)


def _packed(lengths: list[int], vocab: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Batches without a mask whose length changes (packed data): labels are the ids."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, vocab, (2, n), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _eager(model: torch.nn.Module, opt: torch.optim.Optimizer, batch, max_norm: float | None):
    opt.zero_grad()
    out = model(**batch)
    loss = out.loss if hasattr(out, "loss") else out
    loss.backward()
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    return float(loss)


def _assert_params_close(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_background_steps_train_like_eager_across_switches():
    """Two lengths' graphs, each arriving while steps run in eager: the eager steps, the
    graphs' steps and the eager steps between them (the first graph there, a new length
    building) all equal eager's, and so do AdamW's moments at the end."""
    base = gpt2(layers=2, hidden=64, vocab=128)
    ref = copy.deepcopy(base)
    lengths = [20, 30, 18, 40, 24, 44, 20, 37, 46]  # buckets 32 and 48
    batches = _packed(lengths, vocab=128)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    opt = torch.optim.AdamW(base.parameters(), lr=1e-3, weight_decay=0.1)
    trainer = ORTTrainer(base, opt, TrainerOptions(background_build=True, max_grad_norm=1.0))
    background = trainer._program.background
    ran_eager, builds = [], []
    for i, batch in enumerate(batches):
        before = trainer.eager_steps
        loss = float(trainer.train_step(**batch))
        ran_eager.append(trainer.eager_steps > before)
        builds.append(trainer.build_count)
        expected = _eager(ref, opt_ref, batch, max_norm=1.0)
        assert loss == pytest.approx(expected, rel=LOSS_RTOL), f"step {i} (len {lengths[i]})"
        if i in (1, 4):  # let the build in flight arrive (the next step takes it)
            background.wait()
    # 0-1: eager, bucket 32 building; 2: on it; 3: length 40 (bucket 48) eager, building;
    # 4: bucket 32's graph; 5: bucket 48's graph arrived
    assert ran_eager[:6] == [True, True, False, True, False, False], ran_eager
    assert builds[-1] == 2 and trainer.cache_hits == 0
    assert trainer.eager_steps == 3
    assert "built in the background, 3 step(s) in eager meanwhile" in explain(trainer)
    assert not any(ran_eager[5:]), ran_eager
    _assert_adamw_params_close(base, ref, opt_ref, lr=1e-3, steps=len(batches))
    state = trainer.state_dict()["optimizer"]["state"]
    for idx, p in enumerate(q for g in opt_ref.param_groups for q in g["params"]):
        for s in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[idx][s], opt_ref.state[p][s], rtol=1e-4, atol=1e-7)
    assert float(trainer.last_grad_norm) > 0


def _assert_adamw_params_close(a, b, opt_b, lr: float, steps: int) -> None:
    """As ``_assert_params_close``, except elements whose gradient was float noise on
    eager's side (an attention key bias: zero in exact arithmetic), which AdamW moves by up
    to ``lr`` a step in a direction the summation order picks (``tests/adam_noise.py``):
    held to that, ``lr * steps``."""
    scale = max(float(opt_b.state[q]["exp_avg_sq"].max()) for q in b.parameters()) ** 0.5
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        noise = opt_b.state[q]["exp_avg_sq"].sqrt() < NOISE_FLOOR * scale
        diff = (p - q).abs()
        allowed = torch.where(noise, lr * steps, 1e-6 + 1e-5 * q.abs())
        bad = diff > allowed
        assert not bad.any(), f"{name}: {int(bad.sum())} elements, largest {float(diff.max())}"


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)
        )

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.net(x), y)


def test_sgd_momentum_continues_from_eager_steps_into_the_graph():
    """SGD with momentum (torch makes its buffer at the first step): two eager steps, then
    the graph's, with the momentum carried over."""
    torch.manual_seed(0)
    base = _MLP()
    ref = copy.deepcopy(base)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, dampening=0.1)
    opt = torch.optim.SGD(base.parameters(), lr=0.1, momentum=0.9, dampening=0.1)
    trainer = ORTTrainer(base, opt, TrainerOptions(background_build=True))
    background = trainer._program.background
    g = torch.Generator().manual_seed(1)
    for i in range(5):
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)
        loss = float(trainer.train_step(x, y))
        assert loss == pytest.approx(_eager(ref, opt_ref, {"x": x, "y": y}, None), rel=LOSS_RTOL)
        if i == 1:
            background.wait()
    assert trainer.eager_steps == 2 and trainer.build_count == 1
    _assert_params_close(base, ref)


@pytest.mark.parametrize(
    "options, why",
    [
        ({"grad_accumulation_steps": 2}, "grad_accumulation_steps=1"),
        ({"mixed_precision": "fp16"}, "full precision"),
    ],
)
def test_refused_where_eager_steps_cannot_stand_in(options, why):
    model = _MLP()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=f"background_build=True: .*{why}"):
        ORTTrainer(model, opt, TrainerOptions(background_build=True, **options))


def test_eager_steps_refuse_a_non_finite_loss_before_the_update():
    model = _MLP()
    opt = torch.optim.AdamW(model.parameters())
    trainer = ORTTrainer(model, opt, TrainerOptions(background_build=True))
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.full((4, 12), float("nan"))
    with pytest.raises(Exception, match="loss is nan"):
        trainer.train_step(x, torch.zeros(4, dtype=torch.long))
    assert isinstance(trainer._program.background.eager, EagerSteps)
    assert trainer.state.step == 0 and not opt.state
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)
    trainer._program.background.cancel()


def test_a_checkpoint_between_eager_steps_holds_them_and_restores():
    """``state_dict()`` after eager steps (the graph still building) holds their moments and
    step count; loading the checkpoint of step 0 then trains as a fresh eager run (torch's
    optimizer keeps nothing of the steps before)."""
    torch.manual_seed(0)
    base = _MLP()
    ref, fresh = copy.deepcopy(base), copy.deepcopy(base)
    opt = torch.optim.AdamW(base.parameters(), lr=0.05)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.05)
    trainer = ORTTrainer(base, opt, TrainerOptions(background_build=True))
    start = copy.deepcopy(trainer.state_dict())
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g))]
    batches.append((torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)))
    for x, y in batches:
        trainer.train_step(x, y)
        _eager(ref, opt_ref, {"x": x, "y": y}, None)
    assert trainer.eager_steps == 2 and trainer.step == 2
    saved = trainer.state_dict()
    assert saved["ortrain"]["step"] == 2
    params = [p for g in opt_ref.param_groups for p in g["params"]]
    for idx, p in enumerate(params):
        for s in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(saved["optimizer"]["state"][idx][s], opt_ref.state[p][s])
    trainer.load_state_dict(start)
    assert trainer.step == 0
    opt_fresh = torch.optim.AdamW(fresh.parameters(), lr=0.05)
    for x, y in batches:
        loss = float(trainer.train_step(x, y))
        assert loss == pytest.approx(
            _eager(fresh, opt_fresh, {"x": x, "y": y}, None), rel=LOSS_RTOL
        )
    _assert_params_close(base, fresh)
    assert trainer.eager_steps == 4  # the graph still building
    trainer._program.background.cancel()


def test_a_trainer_let_go_mid_build_stops_its_child():
    import gc
    import os

    model = _MLP()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _BACKGROUND)
    trainer.train_step(torch.randn(4, 12), torch.zeros(4, dtype=torch.long))
    pid = trainer._program.background._job.pid
    os.kill(pid, 0)  # building
    del trainer
    gc.collect()
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(pid, 0)
