"""``F.binary_cross_entropy`` on sigmoid probabilities (``nn.BCELoss``) trains like eager
where the sigmoid saturates (``ortrain/export_bce.py``,
``graph_passes/fusions/exact_sigmoid.py``).

Before: torch's decomposition differentiates its clamped logs, NaN at a probability of
exactly 0 or 1 (every parameter NaN after a step with a finite loss), and ONNX Runtime's
Sigmoid, 0 from x = -18 on, clamped ``log p`` at -100 where eager's was about x (a loss of
45.1 against eager's 37.8). The first batch is tame, so the first-step check passes; later
batches saturate (logits of a few hundred and around -20), the gradient taken as torch's
sigmoid backward takes it (0 where p rounds to 1). SGD per-step losses and
parameters against eager, with class weights, every reduction, and soft targets that
themselves train (a teacher's sigmoid); the model is one graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ortrain import ORTTrainer, TrainerOptions


class _Tagger(torch.nn.Module):
    def __init__(self, reduction: str, weighted: bool, soft: bool):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(6, 5)
        self.teacher = torch.nn.Linear(6, 5) if soft else None
        self.register_buffer("w", torch.linspace(0.5, 2.0, 5) if weighted else None)
        self.reduction = reduction

    def forward(self, x, scale, y):
        p = torch.sigmoid(self.fc(x) * scale)
        target = torch.sigmoid(self.teacher(x)) if self.teacher is not None else y
        loss = F.binary_cross_entropy(p, target, weight=self.w, reduction=self.reduction)
        return loss.mean() if self.reduction == "none" else loss


def _batches(saturating: bool) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    # tame, saturated to 0 / 1, the -20s, tame again; a trained target's gradient
    # (-logit(p)) is infinite at saturation in eager: its batches stay below it
    scales = (1.0, 200.0, 20.0, 1.0) if saturating else (1.0, 3.0, 1.0, 5.0)
    return [
        (torch.randn(4, 6, generator=g), torch.tensor(s),
         torch.randint(0, 2, (4, 5), generator=g).float())
        for s in scales
    ]  # fmt: skip


@pytest.mark.parametrize("soft", [False, True], ids=["labels", "teacher"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_saturating_sigmoid_probabilities_train_like_eager(reduction, weighted, soft):
    model, ref = _Tagger(reduction, weighted, soft), _Tagger(reduction, weighted, soft)
    options = TrainerOptions(fallback="off", graph_cache=False, build_progress=False)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01), options)
    opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    exact = _Tagger(reduction, weighted, soft).double()  # float64 eager: what both approach
    opt64 = torch.optim.SGD(exact.parameters(), lr=0.01)
    for i, b in enumerate(_batches(saturating=not soft)):
        want = ref(*b)
        want.backward()
        opt.step()
        opt.zero_grad()
        exact(*(t.double() for t in b)).backward()
        opt64.step()
        opt64.zero_grad()
        got = trainer.train_step(*b)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6, msg=f"step {i}")
    for (name, p), q, e in zip(
        model.named_parameters(), ref.parameters(), exact.parameters(), strict=True
    ):
        assert torch.isfinite(p).all(), name
        if ((p - q).abs() <= 1e-6 + 1e-5 * q.abs()).all():
            continue
        # the saturating batches' logits are 200x the layer's output: a rounding of them
        # (another summation order in another CPU's kernels) moves a gradient by 1e-5 of
        # itself, for eager's float32 as much: no further from float64 than eager is
        ours, theirs = (p.double() - e).norm().item(), (q.double() - e).norm().item()
        assert ours <= 10 * theirs, (name, ours, theirs, (p - q).abs().max().item())
    assert trainer.segments is None
    ops = [n.op_type for n in trainer.train_graphs[0].graph]
    # the exact form feeds the logs; a teacher's sigmoid (a target) keeps ONNX Runtime's
    assert ops.count("Sigmoid") == (1 if soft else 0), ops
