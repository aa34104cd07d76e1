"""GridSample's gradient rule (``graph_passes/autodiff/rules/grid_sample.py``).

1. One GridSample node (opset 20) against torch.autograd's ``F.grid_sample`` in float64
   (``tests/gradcheck.check_gradients``): the gradients of the image and of the grid,
   linear, nearest and cubic, 2-D and 3-D, every padding mode, with and without
   ``align_corners``; grids reaching past the borders so every padding mode matters.
   Cubic sampling (2-D, as torch) too.
2. A spatial-transformer model (a grid from a Linear, sampled from a conv's features)
   trains through ``ORTTrainer`` compiled whole, like eager.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ortrain import ORTTrainer, TrainerOptions
from tests.gradcheck import In, Spec, X, case, check_gradients


def Grid(*shape: int) -> In:
    """Sampling coordinates in [-1.3, 1.3]: past the borders on every side."""
    return In(tuple(shape), "float32", lambda rng, s: rng.uniform(-1.3, 1.3, s), grad=True)


def _spec(id: str, x: In, grid: In, mode: str, padding: str, align: int) -> Spec:
    torch_mode = {"linear": "bilinear", "nearest": "nearest", "cubic": "bicubic"}[mode]

    def ref(img, g):
        return F.grid_sample(
            img, g, mode=torch_mode, padding_mode=padding, align_corners=bool(align)
        )

    attrs = {"mode": mode, "padding_mode": padding, "align_corners": align}
    return case(f"GridSample-{id}-{mode}-{padding}-align{align}", "GridSample", [x, grid], ref,
                attrs=attrs)  # fmt: skip


SPECS = [
    *(
        _spec("2d", X(2, 3, 5, 6), Grid(2, 4, 3, 2), mode, padding, align)
        for mode in ("linear", "nearest")
        for padding in ("zeros", "border", "reflection")
        for align in (0, 1)
    ),
    *(
        _spec("3d", X(2, 2, 3, 4, 5), Grid(2, 2, 3, 2, 3), "linear", padding, align)
        for padding in ("zeros", "border", "reflection")
        for align in (0, 1)
    ),
    *(
        _spec("2d", X(2, 2, 5, 6), Grid(2, 3, 4, 2), "cubic", padding, align)
        for padding in ("zeros", "border", "reflection")
        for align in (0, 1)
    ),
    # an axis of one element (reflection's span is zero there with align_corners)
    *(
        _spec("2d-one-row", X(1, 2, 1, 4), Grid(1, 3, 2, 2), "linear", "reflection", a)
        for a in (0, 1)
    ),
]


@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_rule(spec: Spec) -> None:
    check_gradients(spec)


class _SpatialTransformer(torch.nn.Module):
    """A localization Linear predicts an affine grid per sample; features sampled
    bilinearly from a conv's output, then classified."""

    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Conv2d(2, 4, 3, padding=1)
        self.loc = torch.nn.Linear(2 * 6 * 6, 6)
        self.head = torch.nn.Linear(4 * 5 * 5, 3)

    def forward(self, x, y):
        theta = self.loc(x.flatten(1)).view(-1, 2, 3)
        grid = F.affine_grid(theta, (x.shape[0], 4, 5, 5), align_corners=False)
        sampled = F.grid_sample(
            torch.relu(self.features(x)), grid, padding_mode="border", align_corners=False
        )
        return F.cross_entropy(self.head(sampled.flatten(1)), y)


def test_spatial_transformer_trains_compiled_like_eager() -> None:
    torch.manual_seed(0)
    model = _SpatialTransformer()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    trainer = ORTTrainer(model, opt, TrainerOptions(fallback="off"))
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        batch = {
            "x": torch.randn(4, 2, 6, 6, generator=g),
            "y": torch.randint(0, 3, (4,), generator=g),
        }
        loss = float(trainer.train_step(**batch))
        opt_ref.zero_grad()
        expected = ref(**batch)
        expected.backward()
        opt_ref.step()
        assert loss == pytest.approx(float(expected.detach()), rel=1e-5), step
    ops = {n.op_type for n in trainer.train_graphs[0].graph}
    # compiled whole: the sampling in the graph, its image gradient a scatter-add
    assert trainer.segments is None and "GridSample" in ops
    assert any(op.startswith("ScatterAdd") or op == "ScatterElements" for op in ops), ops
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        np.testing.assert_allclose(p.detach(), q.detach(), rtol=1e-4, atol=1e-6, err_msg=name)
