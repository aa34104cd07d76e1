"""Cross entropy exported with every option's meaning (``ortrain/export_losses.py``).

The exporter's own translation drops ``label_smoothing``; ortrain's keeps it, with class
weights, ``ignore_index``, every reduction, probability targets and inputs without a batch
axis. Each case trains one step with ``fallback="off"`` (no eager to hide behind) and its
loss and every parameter gradient are compared with ``torch.autograd``; the graph keeps
one ``SoftmaxCrossEntropyLoss`` for class-index targets.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ortrain import ORTTrainer, TrainerOptions

C = 5


class _Head(torch.nn.Module):
    def __init__(self, kw: dict):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(6, C)
        weight = kw.pop("weight", None)
        if weight is not None:  # a buffer: it follows the module's dtype and device
            self.register_buffer("weight", weight)
        self.kw = kw

    def forward(self, x, y):
        scores = self.fc(x)
        if scores.ndim == 3:  # [N, d, C] -> [N, C, d]: a class axis of 1 as torch wants
            scores = scores.transpose(1, 2)
        weight = getattr(self, "weight", None)
        return F.cross_entropy(scores, y, weight=weight, **self.kw).sum()


def _cases():
    """Every input rank and reduction with smoothed class indices, class weights with an
    ignored class and without (both under "mean", whose divisor they change), and smoothed
    probabilities under each reduction once."""
    index_cases = {
        (4,): [("mean", False, -100), ("sum", True, 2), ("none", False, -100)],
        (4, 3): [("mean", True, 2), ("sum", False, -100), ("none", True, 2)],
        (): [("mean", True, 2), ("sum", False, -100), ("none", True, 2)],
    }
    soft_cases = {(4,): ("mean", True), (4, 3): ("sum", False), (): ("none", True)}
    for shape, cases in index_cases.items():
        for reduction, weighted, ignore in cases:
            yield shape, reduction, weighted, ignore, 0.15, False
        reduction, weighted = soft_cases[shape]
        yield shape, reduction, weighted, -100, 0.2, True


@pytest.mark.parametrize(
    ("shape", "reduction", "weighted", "ignore", "smoothing", "soft"),
    list(_cases()),
    ids=lambda v: str(v),
)
def test_cross_entropy_trains_like_autograd(shape, reduction, weighted, ignore, smoothing, soft):
    g = torch.Generator().manual_seed(len(shape) * 7 + ignore)
    kw: dict = {"reduction": reduction, "ignore_index": ignore, "label_smoothing": smoothing}
    if weighted:
        kw["weight"] = torch.rand(C, generator=g) + 0.5
    x = torch.randn(*shape, 6, generator=g)
    if soft:
        y = torch.softmax(torch.randn(*shape, C, generator=g), -1)
        y = y.transpose(1, 2) if len(shape) == 2 else y
    else:
        y = torch.randint(0, C, shape, generator=g)
        if ignore >= 0 and y.numel() > 1:
            y.view(-1)[0] = ignore  # one target ignored, at least
    if not shape and not soft and int(y) == ignore:  # one target, ignored: 0/0 in torch too
        y = (y + 1) % C
    model, ref = _Head(dict(kw)), _Head(dict(kw))
    want = ref(x, y)
    want.backward()
    options = TrainerOptions(fallback="off", graph_cache=False, build_progress=False)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0), options)
    got = trainer.train_step(x=x, y=y)
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(trainer.grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert trainer.segments is None and trainer.build_count == 1


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_class_indices_export_one_softmax_cross_entropy(smoothing):
    """Without smoothing the export is the exporter's own single op (what the passes and
    the fusions know); with it, the same op, its log-probabilities read by the term."""
    from ortrain.export import export_forward

    model = _Head({"label_smoothing": smoothing})
    batch = {"x": torch.randn(4, 6), "y": torch.randint(0, C, (4,))}
    ops = [n.op_type for n in export_forward(model, batch, train=True).model.graph]
    assert ops.count("SoftmaxCrossEntropyLoss") == 1
    assert ("ReduceSum" in ops) == (smoothing > 0), ops
