"""aten ops the exporter has no function for, translated (``ortrain/export_aten.py``).

``torch.cdist`` for every p (2, 1, inf, 0 and others), over a batch and against the same
set (zero distances, where torch's gradient is 0), trains one step with
``fallback="off"``: the loss and every parameter gradient against ``torch.autograd``;
the model is one graph.
"""

from __future__ import annotations

import math

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions


class _Prototypes(torch.nn.Module):
    def __init__(self, p: float):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(6, 4)
        self.centres = torch.nn.Parameter(torch.randn(3, 4))
        self.p = p

    def forward(self, x, y):
        h = self.embed(x)  # [batch, set, 4]
        to_centres = torch.cdist(h, self.centres.expand(h.shape[0], -1, -1), p=self.p)
        within = torch.cdist(h, h, p=self.p).mean(-1, keepdim=True)  # zero on the diagonal
        return torch.nn.functional.cross_entropy((within - to_centres).transpose(1, 2), y)


@pytest.mark.parametrize("p", [2.0, 1.0, math.inf, 0.0, 3.0, 0.5])
def test_cdist_trains_like_autograd(p):
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(2, 5, 6, generator=g), torch.randint(0, 3, (2, 5), generator=g)
    model, ref = _Prototypes(p), _Prototypes(p)
    want = ref(x, y)
    want.backward()
    options = TrainerOptions(fallback="off", graph_cache=False, build_progress=False)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0), options)
    torch.testing.assert_close(trainer.train_step(x, y), want.detach(), rtol=1e-5, atol=1e-7)
    for name, q in ref.named_parameters():
        torch.testing.assert_close(trainer.grads[name], q.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert trainer.segments is None
    ops = {n.op_type for n in trainer.train_graphs[0].graph}
    if p == 2.0:
        assert "ReduceL2" in ops or "Sqrt" in ops, ops
