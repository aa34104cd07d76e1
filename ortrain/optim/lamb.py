"""LAMB optimizer (You et al., 2019) as used for BERT pretraining, in eager PyTorch."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class Lamb(torch.optim.Optimizer):
    r"""LAMB: Adam-style update rescaled per parameter tensor by a layer-wise trust ratio.

    The training graph (``graph_passes/training/optimizer/lamb.py``) re-implements exactly these
    semantics. For each parameter ``p`` whose ``.grad`` ``g`` is not None (sparse gradients
    raise ``RuntimeError``), with state ``step`` (float32 0-dim tensor), ``exp_avg`` ``m``
    and ``exp_avg_sq`` ``v`` (zeros like ``p``, created at its first step)::

        step += 1
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat, v_hat = m / (1 - beta1**step), v / (1 - beta2**step)  # if bias_correction
        m_hat, v_hat = m, v                                          # otherwise
        update = m_hat / (sqrt(v_hat) + eps) + weight_decay * p
        trust_ratio = ||p||_2 / ||update||_2  if both norms > 0  else 1.0
        p = p - lr * trust_ratio * update

    ``beta**step`` is computed in Python double with ``step`` as a Python float. Weight decay
    is added to the update (not to the gradient), so it is also scaled by the trust ratio.
    All hyperparameters are read from ``param_groups`` at every step, so LR schedulers work.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One optimization step; an optional ``closure`` recomputes and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2) = group["lr"], group["betas"]
            eps, weight_decay = group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if g.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                step = float(state["step"].item())
                m.mul_(beta1).add_(g * (1.0 - beta1))
                v.mul_(beta2).add_(g * g * (1.0 - beta2))
                m_hat, v_hat = m, v
                if group["bias_correction"]:
                    m_hat, v_hat = m / (1.0 - beta1**step), v / (1.0 - beta2**step)
                update = m_hat / (v_hat.sqrt() + eps) + weight_decay * p
                w_norm = torch.linalg.vector_norm(p)
                u_norm = torch.linalg.vector_norm(update)
                ok = (w_norm > 0) & (u_norm > 0)
                trust = torch.where(ok, w_norm / u_norm, torch.ones_like(w_norm))
                p.sub_(update * (lr * trust))
        return loss
