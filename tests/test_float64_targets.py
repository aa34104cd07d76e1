"""Batches with float64 tensors (numpy's default dtype: regression targets, per-sample
weights) train as eager trains them: the loss promotes to float64 in eager, the graph
reports it in float32, and the gradients reach the float32 parameters through the cast.
A float64 input eager itself refuses (into a float32 ``Linear``) is refused naming it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ortrain import ORTTrainer, TrainerOptions


class _Regression(torch.nn.Module):
    def __init__(self, det: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)
        )
        self.det = det

    def forward(self, x, y, w):
        out = self.body(x)
        if self.det:  # no gradient rule for Det: compiled segments inside eager
            out = (
                out
                + 0.01
                * torch.linalg.det(out.reshape(-1, 2, 1).expand(-1, 2, 2) + torch.eye(2))[:, None]
            )
        per_row = F.smooth_l1_loss(out, y, reduction="none").sum(-1)
        return (per_row * w).sum() / w.sum()


def _batches(n: int) -> list[tuple[torch.Tensor, ...]]:
    rng = np.random.default_rng(0)
    return [
        (
            torch.from_numpy(rng.normal(size=(6, 4))).float(),
            torch.from_numpy(rng.normal(size=(6, 2)) * (1 + 3 * i)),  # float64
            torch.from_numpy(rng.uniform(0.5, 2.0, size=6)),  # float64
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("det", [False, True], ids=["whole", "segments"])
def test_float64_targets_and_weights_train_like_eager(det):
    model, ref = _Regression(det), _Regression(det)
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), TrainerOptions())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for i, (x, y, w) in enumerate(_batches(4)):
        want = ref(x, y, w)
        assert want.dtype == torch.float64
        want.backward()
        opt.step()
        opt.zero_grad()
        got = trainer.train_step(x, y, w)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=0, msg=f"step {i}")
    assert (trainer.segments is not None) == det
    for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)


def test_a_float64_input_eager_refuses_is_named():
    model = _Regression(False)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions())
    x, y, w = _batches(1)[0]
    # (ONNX Runtime's error where the export passed, the exporter's where it did not)
    with pytest.raises(Exception, match=r"eager PyTorch too.*'x' is torch.float64"):
        trainer.train_step(x.double(), y, w)
    trainer.train_step(x, y, w)  # the next good batch trains
    assert trainer.step == 1
