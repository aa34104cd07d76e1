"""The per-element allowance of tests/adam_noise.py on torch's own AdamW: two runs whose
gradients differ by float noise pass (also where the noise is a whole gradient, on one side
exactly zero), and a doubled update, a dropped gradient or a wrong moment still fail."""

from __future__ import annotations

import pytest
import torch

from tests.adam_noise import AdamDrift, assert_params_close

LR, STEPS = 1e-2, 8
TOL = dict(rtol=1e-6, atol=1e-7)


def _gradients(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Real gradients of about 1e-2, except the first 8 elements of ``bias``: zero in exact
    arithmetic, float noise here (1e-8, above Adam's eps: steps of about lr) and the last 4
    of those exactly zero."""
    g = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(STEPS):
        bias = torch.randn(32, generator=g) * 1e-2
        bias[:8] = torch.randn(8, generator=g) * 1e-8
        bias[4:8] = 0.0
        steps.append({"weight": torch.randn(16, 32, generator=g) * 1e-2, "bias": bias})
    return steps


def _noisy(grads: dict[str, torch.Tensor], g: torch.Generator) -> dict[str, torch.Tensor]:
    """What another summation order gives: a few ulps everywhere, other noise where the
    exact value is zero (the side that had exactly zero gets noise)."""
    out = {}
    for name, x in grads.items():
        ulps = 1 + 4e-7 * (torch.rand(x.shape, generator=g) - 0.5)
        out[name] = x * ulps
    out["bias"][:8] = torch.randn(8, generator=g) * 1e-8
    return out


def _run(steps, *, double_at: int | None = None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    params = {"weight": torch.randn(16, 32), "bias": torch.zeros(32)}
    params = {k: torch.nn.Parameter(v) for k, v in params.items()}
    opt = torch.optim.AdamW(params.values(), lr=LR, weight_decay=0.01)
    for t, grads in enumerate(steps):
        for name, p in params.items():
            p.grad = grads[name].clone()
        opt.step()
        if t == double_at:
            opt.step()
    return {k: v.detach() for k, v in params.items()}


def _pair(**b_kw) -> tuple[dict, dict, AdamDrift]:
    a_steps = _gradients()
    g = torch.Generator().manual_seed(7)
    b_steps = [_noisy(s, g) for s in a_steps]
    drift = AdamDrift(LR)
    for a, b in zip(a_steps, b_steps):
        drift.observe(a, b)
    return _run(a_steps), _run(b_steps, **b_kw), drift


def test_float_noise_passes_with_the_allowance_and_only_with_it() -> None:
    a, b, drift = _pair()
    with pytest.raises(AssertionError, match=r"bias: \d+/32 elements differ"):
        assert_params_close(b, a, **TOL)  # the noise elements moved by about lr
    assert_params_close(b, a, **TOL, drift=drift)
    # the allowance is about lr per step where the gradient is noise, near nothing elsewhere
    bias = drift.allowance("bias", a["bias"])
    assert (bias[:8] > LR).all()
    assert bias[8:].max() < 1e-6 * LR * STEPS
    assert drift.allowance("weight", a["weight"]).max() < 1e-6 * LR * STEPS


def test_a_doubled_update_fails() -> None:
    a, b, drift = _pair(double_at=0)
    with pytest.raises(AssertionError, match=r"weight: 512/512 elements differ"):
        assert_params_close(b, a, **TOL, drift=drift)


@pytest.mark.parametrize("wrong", ["dropped", "sign", "moment"])
def test_a_wrong_gradient_fails(wrong: str) -> None:
    """A gradient element dropped or of the wrong sign at one step, or Adam's first moment
    fed twice: the difference is no float noise, and earns no allowance."""
    a_steps = _gradients()
    b_steps = [{k: v.clone() for k, v in s.items()} for s in a_steps]
    if wrong == "dropped":
        b_steps[3]["weight"][2, 5] = 0.0
    elif wrong == "sign":
        b_steps[3]["bias"][20] *= -1
    else:
        b_steps[3]["weight"] = b_steps[3]["weight"] + b_steps[2]["weight"]
    drift = AdamDrift(LR)
    for s_a, s_b in zip(a_steps, b_steps):
        drift.observe(s_a, s_b)
    with pytest.raises(AssertionError, match="elements differ"):
        assert_params_close(_run(b_steps), _run(a_steps), **TOL, drift=drift)


def test_the_step_bound_holds_for_any_gradients() -> None:
    """|m / sqrt(v)| never exceeds AdamDrift.step_bound(t), whatever the gradients."""
    drift = AdamDrift(LR)
    g = torch.Generator().manual_seed(3)
    grads = torch.randn(STEPS, 4096, generator=g) * torch.logspace(-8, 0, 4096)
    grads[:, ::7] = grads[:, ::7].abs()  # same sign at every step: the largest ratios
    m = torch.zeros(4096, dtype=torch.float64)
    v = torch.zeros(4096, dtype=torch.float64)
    for t in range(1, STEPS + 1):
        x = grads[t - 1].double()
        m, v = 0.9 * m + 0.1 * x, 0.999 * v + 0.001 * x * x
        ratio = (m / (1 - 0.9**t)) / (v / (1 - 0.999**t)).sqrt()
        assert ratio.abs().max() <= drift.step_bound(t) * (1 + 1e-12)
    assert drift.step_bound(1) == pytest.approx(1.0)
