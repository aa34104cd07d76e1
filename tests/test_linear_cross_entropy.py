"""``F.linear_cross_entropy`` with ``options`` (torch's chunked path, two custom ops the
exporter has no function for) compiles into the training graph and trains like eager:
``ortrain/export_linear_ce.py`` decomposes the ops into the linear and cross entropy
they equal."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ortrain import ORTTrainer, TrainerOptions

Options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.skipif(Options is None, reason="this torch has no chunked linear_cross_entropy"),
]


class _Head(torch.nn.Module):
    def __init__(self, bias: bool, class_weight: torch.Tensor | None, reduction: str,
                 ignore_index: int | None, unbatched: bool):  # fmt: skip
        super().__init__()
        self.emb = torch.nn.Embedding(20, 8)
        self.head = torch.nn.Linear(8, 11, bias=bias)
        self.class_weight, self.reduction = class_weight, reduction
        self.kw = {} if ignore_index is None else {"ignore_index": ignore_index}
        self.unbatched = unbatched

    def forward(self, ids, target):
        h = torch.tanh(self.emb(ids))
        if self.unbatched:
            h, target = h[1], target[1]
        loss = F.linear_cross_entropy(
            h, self.head.weight, target, linear_bias=self.head.bias, weight=self.class_weight,
            reduction=self.reduction, options=Options(), **self.kw,
        )  # fmt: skip
        if self.reduction == "none":  # rows weighted unequally: each row's loss is compared
            loss = (loss * torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape)).sum()
        return loss


@pytest.mark.parametrize(
    ("bias", "weighted", "reduction", "ignore_index", "unbatched"),
    [
        (True, False, "mean", None, False),
        (False, True, "mean", 3, False),
        (True, True, "sum", 3, False),
        (False, False, "sum", None, True),
        (True, True, "none", 3, False),
        (False, False, "none", None, True),
    ],
)
def test_chunked_linear_cross_entropy_compiles_and_trains_like_eager(
    bias, weighted, reduction, ignore_index, unbatched
):
    g = torch.Generator().manual_seed(0)
    class_weight = torch.rand(11, generator=g) + 0.5 if weighted else None
    ids = torch.randint(0, 20, (6,), generator=g)
    target = torch.randint(0, 11, (6,), generator=g)
    target[4] = 3  # an ignored row where ignore_index is 3
    torch.manual_seed(0)
    args = (bias, class_weight, reduction, ignore_index, unbatched)
    model, ref = _Head(*args), _Head(*args)
    ref.load_state_dict(model.state_dict())
    trainer = ORTTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.5),
        TrainerOptions(build_progress=False, fallback="off"),
    )  # fmt: skip
    losses = [trainer.train_step(ids, target) for _ in range(2)]
    trainer.sync_to_module()
    assert trainer.segments is None  # one training graph, nothing in eager
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for loss in losses:
        opt.zero_grad()
        want = ref(ids, target)
        want.backward()
        opt.step()
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
