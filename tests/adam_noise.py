"""How far two AdamW runs may end apart, element by element, when their gradients differ by
float noise; for the tests that compare parameters after AdamW steps.

Adam divides each element's first moment by the root of its second, so the size of an
element's step does not depend on the size of its gradient. An element whose gradient is
float noise on both sides (zero in exact arithmetic: an attention key bias, the embedding
row of a token seen only where no loss reaches it) takes steps of up to lr on each side,
in directions and sizes that the summation order decides: another thread count, another
machine load, another GPU kernel. One tolerance for every element either allows that
everywhere (and cannot see a bug) or nowhere (and fails on whichever element the noise
picks). ``AdamDrift`` allows, per element, what the difference between the two sides'
own gradients can move Adam's step, and nothing for a difference beyond float noise:

1. per step t, each element's gradient on side A (``g``) and side B (``g'``); the noise
   ``n_t = min(|g - g'|, floor * G_t)``, where ``G_t`` is the largest gradient of the whole
   model at that step on either side: a difference above ``floor * G_t`` is not float
   noise and earns nothing;
2. Adam's bias-corrected moments over A's gradients, ``m`` and ``v``, ``s = sqrt(v)``,
   A's step ``u = m / (s + eps)``, and the same moving averages of the noise:
   ``Dm`` (weights of ``m``) and ``Dv = sqrt(EMA_beta2(n**2))`` (weights of ``v``);
3. B's first moment is within ``Dm`` of A's and ``sqrt`` of its second within ``Dv``
   (triangle inequality over the moments' weights), so B's step ``u'`` satisfies
   ``|u' - u| <= (Dm + |u| * Dv) / (max(s - Dv, 0) + eps)``, and never more than
   ``2 * U_t``, where ``U_t = sqrt(sum(a**2 / b))`` (``a``, ``b`` the weights of ``m``
   and ``v`` at step t) bounds any Adam step (Cauchy-Schwarz);
4. the parameters may differ by ``lr`` times the sum of those bounds over the steps
   (decoupled weight decay only shrinks a difference).

An element with a real gradient has ``n / s`` near 1e-7 and is held to the test's own
tolerance; a doubled or skipped update, a dropped or doubled gradient, a wrong moment
move it by about lr and fail.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

NOISE_FLOOR = 1e-6  # float noise in a gradient: below this x the model's largest gradient


def _largest(x: torch.Tensor) -> float:
    return x.abs().max().item() if x.numel() else 0.0


class AdamDrift:
    """The per-element allowance for two Adam/AdamW runs with the same hyperparameters."""

    def __init__(
        self,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        floor: float = NOISE_FLOOR,
    ) -> None:
        self.lr, self.eps, self.floor = lr, eps, floor
        self.b1, self.b2 = betas
        # per parameter: step count, A's moments, the noise's moving averages, the allowance
        self._t: dict[str, int] = {}
        self._m: dict[str, torch.Tensor] = {}
        self._v: dict[str, torch.Tensor] = {}
        self._dm: dict[str, torch.Tensor] = {}
        self._dv: dict[str, torch.Tensor] = {}
        self._allowed: dict[str, torch.Tensor] = {}

    def step_bound(self, t: int) -> float:
        """The largest |m / sqrt(v)| any gradients give at step ``t`` (1-based)."""
        b1, b2 = self.b1, self.b2
        c1, c2 = 1 - b1**t, 1 - b2**t
        return math.sqrt(
            sum(
                ((1 - b1) * b1 ** (t - k) / c1) ** 2 / ((1 - b2) * b2 ** (t - k) / c2)
                for k in range(1, t + 1)
            )
        )

    def observe(self, a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
        """One optimizer step: the gradients each side's update read (same names; a
        parameter without a gradient this step is left out of both)."""
        assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
        ga = {k: v.detach().to("cpu", torch.float64) for k, v in a.items()}
        gb = {k: v.detach().to("cpu", torch.float64) for k, v in b.items()}
        largest = max((_largest(x) for x in [*ga.values(), *gb.values()]), default=0.0)
        cap = self.floor * largest
        for name, g in ga.items():
            noise = (g - gb[name]).abs().clamp(max=cap)
            t = self._t.get(name, 0) + 1
            self._t[name] = t
            zero = torch.zeros_like(g)
            m = self.b1 * self._m.get(name, zero) + (1 - self.b1) * g
            v = self.b2 * self._v.get(name, zero) + (1 - self.b2) * g * g
            dm = self.b1 * self._dm.get(name, zero) + (1 - self.b1) * noise
            dv = self.b2 * self._dv.get(name, zero) + (1 - self.b2) * noise * noise
            self._m[name], self._v[name], self._dm[name], self._dv[name] = m, v, dm, dv
            c1, c2 = 1 - self.b1**t, 1 - self.b2**t
            s, d_m, d_v = (v / c2).sqrt(), dm / c1, (dv / c2).sqrt()
            u = (m / c1) / (s + self.eps)
            bound = (d_m + u.abs() * d_v) / ((s - d_v).clamp(min=0) + self.eps)
            bound = bound.clamp(max=2 * self.step_bound(t))
            self._allowed[name] = self._allowed.get(name, zero) + self.lr * bound

    def allowance(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """How far parameter ``name`` may differ, per element (zero where no step saw it)."""
        got = self._allowed.get(name)
        if got is None:
            return torch.zeros_like(like, dtype=torch.float64, device="cpu")
        return got


class TrainerGradients:
    """The gradients an ``ORTTrainer``'s update read at each optimizer step: its gradient
    buffers where its engine keeps them, else (the update inside the backward keeps none)
    recovered from Adam's first moment, ``g_t = (m_t - beta1 * m_(t-1)) / (1 - beta1)``, in
    float64 (off by ORT's rounding of ``m_t``: about 1e-6 of ``|m_t|``)."""

    def __init__(self, trainer, beta1: float = 0.9) -> None:
        self.trainer, self.beta1 = trainer, beta1
        self._m: dict[str, torch.Tensor] = {}

    def __call__(self, names) -> dict[str, torch.Tensor]:
        """Call once after every optimizer step, with the parameters to read."""
        grads, states, out = self.trainer.grads, self.trainer.opt_state, {}
        for name in names:
            if not self.trainer.update_engine.in_backward:
                out[name] = grads[name].detach().to("cpu", torch.float64)
                continue
            m = states[f"exp_avg:{name}"].detach().to("cpu", torch.float64)
            before = self._m.get(name, torch.zeros_like(m))
            out[name] = (m - self.beta1 * before) / (1 - self.beta1)
            self._m[name] = m
        return out


def assert_params_close(
    actual: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    *,
    rtol: float,
    atol: float,
    drift: AdamDrift | None = None,
) -> None:
    """Every parameter element within ``atol + rtol * |expected|``, plus, with ``drift``,
    its own allowance for Adam's float-noise steps; the message names the parameter, how
    many elements differ and the worst one."""
    assert actual.keys() == expected.keys(), sorted(set(actual) ^ set(expected))
    for name, want in expected.items():
        want = want.detach().to("cpu", torch.float64)
        got = actual[name].detach().to("cpu", torch.float64)
        allowed = atol + rtol * want.abs()
        if drift is not None:
            allowed = allowed + drift.allowance(name, want)
        err = (got - want).abs()
        bad = err > allowed
        if bad.any():
            i = int((err - allowed).flatten().argmax())
            raise AssertionError(
                f"{name}: {int(bad.sum())}/{bad.numel()} elements differ; worst at flat index "
                f"{i}: {got.flatten()[i].item():.8g} vs {want.flatten()[i].item():.8g} "
                f"(error {err.flatten()[i].item():.3g}, allowed {allowed.flatten()[i].item():.3g})"
            )
