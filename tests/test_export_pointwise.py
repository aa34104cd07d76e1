"""``hypot``, ``copysign``, ``signbit`` and ``erfinv`` compiled
(``ortrain/export_pointwise.py``): values and gradients equal torch's, signed zeros and
erfinv's ends included."""

from __future__ import annotations

import copy

import torch

from ortrain import ORTTrainer, TrainerOptions

# both of erfinv's branches (|x| < 0.9966...: the central one), near its ends
POINTS = [-0.9999, -0.998, -0.9, -0.5, -0.1, 0.0, 1e-6, 0.3, 0.7, 0.99, 0.9975, 0.99999]


class _Pointwise(torch.nn.Module):
    """Each function at the points through an offset of its own that starts at 0: after
    one SGD step of rate 1 the offset holds minus that function's gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("points", torch.tensor(POINTS))
        self.register_buffer("signs", torch.tensor([0.0, -0.0, 2.0, -3.0] * 3))
        self.offsets = torch.nn.ParameterDict(
            {k: torch.nn.Parameter(torch.zeros(len(POINTS))) for k in ("hypot", "sign", "inv")}
        )

    def forward(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        p = self.points
        values = {
            "hypot": torch.hypot(p + self.offsets["hypot"], 3 * p.flip(0) + 0.5),
            "copy": torch.copysign(p + self.offsets["sign"], self.signs),
            "copy_scalar": torch.copysign(p + self.offsets["sign"], -0.0),
            "inv": torch.erfinv(p + self.offsets["inv"]),
        }
        loss = sum((v * w).sum() for v in values.values())
        return {"loss": loss, "signbit": torch.signbit(self.signs * p), **values}


def test_values_and_gradients_equal_torchs() -> None:
    model = _Pointwise()
    ref = copy.deepcopy(model)
    options = TrainerOptions(fallback="off")  # compiled, or the test fails
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=1.0), options)
    w = torch.linspace(0.5, 1.5, len(POINTS))
    outputs = trainer.eval_step(w=w)
    with torch.no_grad():
        for name, value in ref(w).items():
            if value.dtype == torch.bool:
                assert torch.equal(outputs[name], value), name
            else:  # erfinv: a Newton step against float32's erf, a few ulps from torch's
                torch.testing.assert_close(outputs[name], value, rtol=1e-6, atol=1e-7, msg=name)
    want = ref(w)
    want["loss"].backward()
    got = trainer.train_step(w=w)
    assert trainer.segments is None
    torch.testing.assert_close(got, want["loss"].detach(), rtol=1e-6, atol=0)
    trainer.sync_to_module()
    for name, offset in model.offsets.items():
        grad = ref.offsets[name].grad
        torch.testing.assert_close(-offset.detach(), grad, rtol=2e-6, atol=1e-6, msg=name)


def test_erfinv_at_and_beyond_its_ends_is_torchs() -> None:
    class Ends(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(()))

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": torch.erfinv(x * 0.5 * self.scale).sum(), "ends": torch.erfinv(x)}

    model = Ends()
    trainer = ORTTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions(fallback="off")
    )
    x = torch.tensor([-2.0, -1.0, -0.5, 1.0, 1.5, float("nan")])
    got = trainer.eval_step(x=x)["ends"]
    torch.testing.assert_close(got, torch.erfinv(x), equal_nan=True)
