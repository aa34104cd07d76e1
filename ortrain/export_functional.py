"""``torch.nn.functional`` functions whose eager meaning a trace loses, swapped while a
model exports (``functional_for_export``; eager PyTorch is untouched):

1. ``F.gaussian_nll_loss`` (``nn.GaussianNLLLoss``) raises ``ValueError`` where the
   variance has a negative entry: a branch on the tensor's values, which stopped every
   export of a model with that loss. The version here computes the same loss (torch's
   order of operations: the variance clamped to ``eps`` without its gradient seeing the
   clamp, ``full``'s constant, every reduction, a homoscedastic variance one axis short)
   with the check kept as data: a negative entry becomes NaN, so the step's loss is NaN
   and the finite-loss check (``TrainerOptions.check_finite``, on by default) refuses the
   step before its update, where eager raises.
2. ``F.cosine_similarity`` (``nn.CosineSimilarity``) clamps each norm to ``eps`` under
   no_grad: the gradient flows as if unclamped. Traced, the clamp is an ordinary one,
   whose gradient is zero where it clamps (a model with a large ``eps`` trained another
   gradient; the first-step check sent it to eager). The version here clamps the value
   and passes the gradient straight through, as eager does.
3. ``F.embedding`` with ``scale_grad_by_freq=True`` divides each occurrence's gradient
   by how often its index occurs in the batch, a backward-only option the exporter
   drops (the rows' gradient came out unscaled). The version here reads the rows as
   without it and scales the path the gradient takes by 1 / count, the value unchanged.
4. ``F.embedding_bag`` with a ``padding_idx``: the exporter's
   translation loops over the bags with a branch inside that reads the weights, which
   the gradient cannot cross. The version here gathers every row at once and reduces
   the bags in one step (a row per bag for 2-D input; for offsets, a bag-membership
   matrix times the rows), the padding's rows masked out of the sums, the means' counts
   and the maxima; an empty bag is zeros, as torch's.
5. ``nn.RNN`` (tanh or relu) with ``dropout`` between its layers: torch's decomposition of
   ``rnn_tanh`` / ``rnn_relu``, which the trace runs, never applies that dropout (its
   test of the layer index is always false), so the graph trained without it. Here the
   call is made one layer at a time with ``torch.dropout`` between, as eager's kernel
   draws it (``nn.LSTM`` / ``nn.GRU`` export their dropout already).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F


def _gaussian_nll_loss(
    input: torch.Tensor,
    target: torch.Tensor,
    var: torch.Tensor | float,
    full: bool = False,
    eps: float = 1e-6,
    reduction: str = "mean",
) -> torch.Tensor:
    if isinstance(var, float):
        if var < 0:
            raise ValueError("var has negative entry/entries")
        var = var * torch.ones_like(input)
    if var.size() != input.size():
        if input.size()[:-1] == var.size():
            var = torch.unsqueeze(var, -1)
        elif not (
            input.ndim == var.ndim
            and sum(y for x, y in zip(input.size(), var.size(), strict=True) if x != y) == 1
        ):
            raise ValueError("var is of incorrect size")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(reduction + " is not valid")
    var = torch.where(var < 0, torch.full_like(var, math.nan), var)  # eager raises
    var = _clamped_value_only(var, eps)
    loss = 0.5 * (torch.log(var) + (input - target) ** 2 / var)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    return loss


def _clamped_value_only(t: torch.Tensor, low: float) -> torch.Tensor:
    """``t`` clamped below at ``low``, its gradient that of ``t`` (torch clamps a clone in
    place under no_grad)."""
    return t + (t.clamp(min=low) - t).detach()


def _cosine_similarity(
    x1: torch.Tensor, x2: torch.Tensor, dim: int = 1, eps: float = 1e-8
) -> torch.Tensor:
    x1, x2 = torch.broadcast_tensors(x1, x2)
    n1 = torch.linalg.vector_norm(x1, 2, dim=dim, keepdim=True)
    n2 = torch.linalg.vector_norm(x2, 2, dim=dim, keepdim=True)
    return ((x1 / _clamped_value_only(n1, eps)) * (x2 / _clamped_value_only(n2, eps))).sum(dim)


_EMBEDDING = F.embedding


def _embedding(
    input: torch.Tensor,
    weight: torch.Tensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> torch.Tensor:
    rows = _EMBEDDING(input, weight, padding_idx, max_norm, norm_type, False, sparse)
    if not scale_grad_by_freq:
        return rows
    flat = input.reshape(-1)
    counts = torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device)
    counts = counts.scatter_add(0, flat, torch.ones_like(flat, dtype=weight.dtype))
    scale = (1.0 / counts[input]).unsqueeze(-1)
    return rows.detach() + (rows - rows.detach()) * scale


_EMBEDDING_BAG = F.embedding_bag


def _embedding_bag(
    input: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor | None = None,
    max_norm: float | None = None,
    norm_type: float = 2,
    scale_grad_by_freq: bool = False,
    mode: str = "mean",
    sparse: bool = False,
    per_sample_weights: torch.Tensor | None = None,
    include_last_offset: bool = False,
    padding_idx: int | None = None,
) -> torch.Tensor:
    args = (input, weight, offsets, max_norm, norm_type, scale_grad_by_freq, mode, sparse,
            per_sample_weights, include_last_offset, padding_idx)  # fmt: skip
    # (with scale_grad_by_freq torch's CPU backward scales other rows than embedding's
    # does: left to the exporter, and so to the first-step check)
    plain = padding_idx is None or scale_grad_by_freq
    offsets_max = input.dim() == 1 and mode == "max"  # (its windows would not fit memory)
    if plain or max_norm is not None or offsets_max or input.dim() not in (1, 2):
        return _EMBEDDING_BAG(*args)
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    rows = _EMBEDDING(input, weight)
    keep = (
        input != padding_idx
        if padding_idx is not None
        else torch.ones_like(input, dtype=torch.bool)
    )
    counted = keep.to(weight.dtype)
    weights = counted if per_sample_weights is None else counted * per_sample_weights
    if input.dim() == 2:  # each row a bag
        if mode == "max":  # the first maximum of the kept entries, as torch's kernel
            masked = rows.masked_fill(~keep[..., None], -math.inf)
            first = masked.argmax(1, keepdim=True)
            top = masked.gather(1, first).squeeze(1)
            return torch.where(keep.any(1, keepdim=True), top, torch.zeros_like(top))
        total = (rows * weights[..., None]).sum(1)
        return total if mode == "sum" else total / counted.sum(1, keepdim=True).clamp(min=1)
    assert offsets is not None
    position = torch.arange(input.shape[0], device=input.device)
    starts = offsets[:-1] if include_last_offset else offsets
    ends = (
        offsets[1:]
        if include_last_offset
        else torch.cat([offsets[1:], offsets.new_tensor([input.shape[0]])])
    )
    member = ((position[:, None] >= starts[None, :]) & (position[:, None] < ends[None, :])).to(
        weight.dtype
    )
    total = member.t() @ (rows * weights[:, None])
    return total if mode == "sum" else total / (member.t() @ counted[:, None]).clamp(min=1)


class _LayeredRNN:
    """``torch._VF`` as ``nn.RNN`` reads it, with ``rnn_tanh`` / ``rnn_relu`` in training
    with inter-layer dropout called layer by layer (item 5); everything else is torch's."""

    def __init__(self, vf: object):
        self._vf = vf
        self.rnn_tanh = self._layered(vf.rnn_tanh)  # type: ignore[attr-defined]
        self.rnn_relu = self._layered(vf.rnn_relu)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._vf, name)

    @staticmethod
    def _layered(original):
        def call(*args, **kwargs):
            # the padded-input form: (input, hx, weights, bias, layers, p, train, bidir,
            # batch_first); a packed sequence passes integer batch sizes second
            if kwargs or len(args) != 9 or not args[1].is_floating_point():
                return original(*args, **kwargs)
            x, hx, weights, bias, layers, p, train, bidirectional, batch_first = args
            if not (train and p > 0 and layers > 1):
                return original(*args)
            dirs = 2 if bidirectional else 1
            per = (4 if bias else 2) * dirs  # weights layer by layer, direction by direction
            finals = []
            for i in range(layers):
                x, h = original(
                    x, hx[i * dirs : (i + 1) * dirs], weights[i * per : (i + 1) * per],
                    bias, 1, 0.0, train, bidirectional, batch_first,
                )  # fmt: skip
                finals.append(h)
                if i < layers - 1:
                    x = torch.dropout(x, p, True)
            return x, torch.cat(finals, 0)

        return call


SWAPS = {
    "gaussian_nll_loss": _gaussian_nll_loss,
    "cosine_similarity": _cosine_similarity,
    "embedding": _embedding,
    "embedding_bag": _embedding_bag,
}


@contextlib.contextmanager
def functional_for_export() -> Iterator[None]:
    """``SWAPS`` in ``torch.nn.functional`` and ``nn.RNN``'s layered call (item 5) for the
    duration (module docstring)."""
    from torch.nn.modules import rnn

    originals = {name: getattr(F, name) for name in SWAPS}
    vf = rnn._VF
    for name, fn in SWAPS.items():
        setattr(F, name, fn)
    rnn._VF = _LayeredRNN(vf)
    try:
        yield
    finally:
        rnn._VF = vf
        for name, fn in originals.items():
            setattr(F, name, fn)
