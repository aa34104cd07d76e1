"""aten ops the ONNX exporter has no function for, decomposed before it translates.

1. Adaptive pooling (``nn.AdaptiveMaxPool1d/2d/3d`` with or without indices, and
   ``nn.AdaptiveAvgPool3d``): output cell ``i`` of an axis of length ``L`` pooled to
   ``O`` reads the window ``[floor(i L / O), ceil((i + 1) L / O))``, whose length varies
   where O does not divide L. Each axis gets a table of its windows' indices, padded to
   the longest window, and one ``index_select`` per axis gathers every window at once;
   so the graph is gathers, a reduction and (for max) an ``argmax``, each with its
   gradient rule. For max, the padding repeats a window's last index (a repeat never
   beats the first occurrence of its value) and the value is read at the ``argmax``
   over the window in scan order: the gradient goes to the window's first maximum, as
   torch's kernel sends it, not spread over ties. For the average the padding points at
   a zero appended to the axis, and each window's sum is divided by its own length.

2. ``F.pdist``: the distances of every pair of rows, read off their ``cdist`` (which
   has a translation, ``ortrain/export_aten.py``).

3. ``MultiLabelMarginLoss``: a row's targets end at its first -1 (torch's decomposition,
   which the exporter would use, reads on past it).

4. ``FractionalMaxPool2d/3d`` given its samples (``_random_samples``, or the draw the
   module makes, a random op in the graph): windows of fixed size whose starts are
   computed from the samples as torch computes them, gathered like adaptive pooling's.

5. ``RReLU``: its slopes drawn in the graph for the elements at or below zero.

6. ``F.binary_cross_entropy`` (``nn.BCELoss``): no longer here; translated as one op
   (``ortrain/export_bce.py``, the same math) so that its target can be range-checked.

``exporter_decompositions()`` adds them, and those of ``export_scans.py`` (``cumprod``,
``cummax``, ``cummin``) and ``export_pointwise.py`` (``hypot``, ``copysign``,
``signbit``, ``erfinv``), ``export_linear_ce.py`` (``F.linear_cross_entropy``'s
chunked path), ``export_order.py`` (``searchsorted``) and ``export_stacks.py``
(``hstack``, ``vstack``, ``dstack``, ``column_stack``), to the exporter's own decomposition table
(which holds torch's decompositions of the ops without an ONNX function; torch's
``adaptive_max_pool2d`` one covers divisible sizes only and spreads a global pool's
gradient over ties).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from ortrain.export_fake_quantize import fake_quantize_decompositions
from ortrain.export_linear_ce import linear_ce_decompositions
from ortrain.export_order import searchsorted_decompositions
from ortrain.export_pointwise import pointwise_decompositions
from ortrain.export_scans import scan_decompositions
from ortrain.export_stacks import stack_decompositions

aten = torch.ops.aten
_NP = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}


def _windows(
    length: int, out: int, pad: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, k] source indices of each output cell's window, padded to the longest (k)
    with ``pad`` (-1: the window's own last index), and [out] each window's length.
    Spelled as tensor arithmetic (no ``torch.tensor`` of a list: a trace would make that
    an in-place lift the exporter's decomposition refuses)."""
    k = max(-((-(i + 1) * length) // out) - (i * length) // out for i in range(out))
    cell = torch.arange(out, device=device)
    starts = (cell * length) // out
    ends = ((cell + 1) * length + out - 1) // out
    idx = starts[:, None] + torch.arange(k, device=device)[None, :]
    inside = idx < ends[:, None]
    fill = ends[:, None] - 1 if pad < 0 else torch.full_like(idx, pad)
    return torch.where(inside, idx, fill), ends - starts


def _gathered(x: torch.Tensor, tables: Sequence[torch.Tensor]) -> torch.Tensor:
    """x [..., L_1 .. L_d] -> [..., O_1 .. O_d, K_1 * .. * K_d]: every window's elements."""
    d = len(tables)
    lead = x.dim() - d
    for j, table in enumerate(tables):
        axis = lead + 2 * j  # the axes before it are (O, K) pairs by now
        x = x.index_select(axis, table.flatten())
        x = x.unflatten(axis, tuple(table.shape))
    order = [*range(lead)]
    order += [lead + 2 * j for j in range(d)] + [lead + 2 * j + 1 for j in range(d)]
    return x.permute(order).flatten(lead + d)


def adaptive_max_pool(
    x: torch.Tensor, output_size: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Values and flat indices (into the pooled axes) of each window's first maximum."""
    d = len(output_size)
    sizes, lead = x.shape[-d:], x.dim() - d
    tables = [_windows(n, o, -1, x.device)[0] for n, o in zip(sizes, output_size, strict=True)]
    first = _gathered(x, tables).argmax(dim=-1, keepdim=True)  # scan order's first
    values = _gathered(x, tables).gather(-1, first).squeeze(-1)
    first = first.squeeze(-1)
    widths = [t.shape[1] for t in tables]
    index = torch.zeros_like(first)
    for j, table in enumerate(tables):
        offset = (first // math.prod(widths[j + 1 :])) % widths[j]
        shape = [1] * (lead + d)
        shape[lead + j] = table.shape[0]
        cell = torch.arange(table.shape[0], device=x.device).view(shape) * widths[j]
        source = table.flatten()[(cell + offset).flatten()].view(offset.shape)
        index = index * sizes[j] + source
    return values, index


def adaptive_avg_pool(x: torch.Tensor, output_size: Sequence[int]) -> torch.Tensor:
    """Each window's mean: a zero appended to every pooled axis fills the shorter
    windows, and each sum is divided by its window's own length."""
    d = len(output_size)
    sizes, lead = x.shape[-d:], x.dim() - d
    pairs = [_windows(n, o, n, x.device) for n, o in zip(sizes, output_size, strict=True)]
    padded = torch.nn.functional.pad(x, [0, 1] * d)
    sums = _gathered(padded, [t for t, _ in pairs]).sum(-1)
    counts = None
    for j, (_, lengths) in enumerate(pairs):
        shape = [1] * (lead + d)
        shape[lead + j] = lengths.shape[0]
        axis = lengths.to(x.dtype).view(shape)
        counts = axis if counts is None else counts * axis
    return sums / counts


def _max(x: torch.Tensor, output_size: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return adaptive_max_pool(x, list(output_size))


def _avg(x: torch.Tensor, output_size: Sequence[int]) -> torch.Tensor:
    return adaptive_avg_pool(x, list(output_size))


def _pdist(x: torch.Tensor, p: float = 2.0) -> torch.Tensor:
    """``F.pdist``: the pairwise distances of the rows, i < j in row-major order, read
    off their ``cdist`` (whose translation keeps zero distances' gradients at 0, as
    pdist's backward)."""
    n = x.shape[0]
    pairs = torch.triu_indices(n, n, 1, device=x.device)
    whole = aten._cdist_forward(x, x, p, None)
    return whole.flatten()[pairs[0] * n + pairs[1]]


def _multilabel_margin(
    x: torch.Tensor, target: torch.Tensor, reduction: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``MultiLabelMarginLoss``: a row's targets are its entries before the first -1;
    for each target j and each class c not a target, ``max(0, 1 - x[j] + x[c])``,
    summed and divided by the class count (torch's own decomposition reads the entries
    after a -1 as targets too)."""
    single = x.dim() == 1
    if single:
        x, target = x.unsqueeze(0), target.unsqueeze(0)
    valid = torch.cumsum((target < 0).to(torch.int64), dim=1) == 0  # before the first -1
    safe = target.clamp(min=0)
    counts = torch.zeros_like(x).scatter_add(1, safe, valid.to(x.dtype))
    is_target = (counts > 0).to(x.dtype)
    picked = x.gather(1, safe)
    margins = torch.relu(1.0 - picked[:, :, None] + x[:, None, :])
    margins = margins * valid.to(x.dtype)[:, :, None] * (1.0 - is_target)[:, None, :]
    loss = margins.sum((1, 2)) / x.shape[1]
    if reduction == 1:
        loss = loss.mean()
    elif reduction == 2:
        loss = loss.sum()
    elif single:
        loss = loss.squeeze(0)
    return loss, is_target.squeeze(0) if single else is_target


def _fractional_max(
    x: torch.Tensor, kernel: Sequence[int], out: Sequence[int], samples: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``FractionalMaxPool2d/3d`` given its samples: along an axis of length ``L`` with
    window ``k`` pooled to ``O`` cells, cell ``i`` < O - 1 starts at
    ``int((i + u) a) - int(u a)`` with ``a = (L - k) / (O - 1)`` in the input's float type
    (torch's arithmetic), the last at ``L - k``; ``u`` is the (sample, channel)'s draw for
    that axis (2-D: the width's first; 3-D: in axis order). Each window's first maximum in
    scan order, as torch's kernel, with its flat index."""
    d = len(kernel)
    single = x.dim() == d + 1
    if single:
        x = x.unsqueeze(0)
    n, c, sizes = x.shape[0], x.shape[1], x.shape[2:]
    draw = [1, 0] if d == 2 else list(range(d))  # the sample each spatial axis reads
    tables = []
    for j in range(d):
        length, k, o = sizes[j], kernel[j], out[j]
        u = samples[..., draw[j]].to(x.dtype)  # [N, C]
        cells = torch.arange(o, device=x.device, dtype=x.dtype)
        if o > 1:
            # the quotient as torch's kernel rounds it (a plain number: a traced
            # torch.tensor would be an in-place lift the exporter refuses)
            alpha = float(np.array(length - k, _NP[x.dtype]) / np.array(o - 1, _NP[x.dtype]))
            start = ((cells[None, None, :] + u[..., None]) * alpha).to(torch.int64)
            start = start - (u * alpha).to(torch.int64)[..., None]
            start = torch.cat([start[..., :-1], torch.full_like(start[..., -1:], length - k)], -1)
        else:
            start = torch.full((n, c, 1), length - k, dtype=torch.int64, device=x.device)
        tables.append(start[..., None] + torch.arange(k, device=x.device))  # [N, C, O, k]
    windows = x
    for j, table in enumerate(tables):
        axis = 2 + 2 * j
        flat = table.flatten(2)  # [N, C, O_j * k_j]
        shape = list(windows.shape)
        view = [n, c] + [1] * (len(shape) - 2)
        view[axis] = flat.shape[2]
        index = flat.view(view).expand(*shape[:axis], flat.shape[2], *shape[axis + 1 :])
        windows = windows.gather(axis, index).unflatten(axis, tuple(table.shape[2:]))
    order = [0, 1, *(2 + 2 * j for j in range(d)), *(3 + 2 * j for j in range(d))]
    windows = windows.permute(order).flatten(2 + d)  # [N, C, O..., K]
    first = windows.argmax(-1, keepdim=True)
    values = windows.gather(-1, first).squeeze(-1)
    first = first.squeeze(-1)
    widths = [t.shape[3] for t in tables]
    index = torch.zeros_like(first)
    for j, table in enumerate(tables):
        offset = (first // math.prod(widths[j + 1 :])) % widths[j]  # [N, C, O...]
        cells = table.flatten(2)  # [N, C, O_j * k_j]
        shape = [1, 1] + [1] * d
        shape[2 + j] = table.shape[2]
        base = torch.arange(table.shape[2], device=x.device).view(shape) * widths[j]
        pick = (base + offset).flatten(2)
        source = cells.gather(2, pick).view(offset.shape)
        index = index * sizes[j] + source
    if single:
        values, index = values.squeeze(0), index.squeeze(0)
    return values, index


def _rrelu(
    x: torch.Tensor,
    noise: torch.Tensor,
    lower: float = 0.125,
    upper: float = 1.0 / 3.0,
    training: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``RReLU``: in training each element at or below zero is scaled by a slope drawn
    uniformly from [lower, upper] (a draw in the graph, as eager draws its own), in
    evaluation by their mean; the slopes are also its second output, as torch's."""
    if training:
        slope = torch.rand_like(x) * (upper - lower) + lower
    else:
        slope = torch.full_like(x, (lower + upper) / 2)
    slopes = torch.where(x <= 0, slope, torch.ones_like(x))
    return x * slopes, slopes


TABLE: dict[torch._ops.OpOverload, Callable] = {
    aten.rrelu_with_noise_functional.default: _rrelu,
    aten.fractional_max_pool2d.default: _fractional_max,
    aten.fractional_max_pool3d.default: _fractional_max,
    aten.multilabel_margin_loss_forward.default: _multilabel_margin,
    aten._pdist_forward.default: _pdist,
    aten.adaptive_max_pool2d.default: _max,
    aten.adaptive_max_pool3d.default: _max,
    aten._adaptive_avg_pool3d.default: _avg,
}


@contextlib.contextmanager
def exporter_decompositions() -> Iterator[None]:
    """The exporter's decomposition table (what it decomposes before translating: ops
    without an ONNX function) with ``TABLE``'s entries in it, for one export."""
    from torch.onnx._internal.exporter import _decomp

    original = _decomp.create_onnx_friendly_decomposition_table

    def with_ours(registered: set) -> dict:
        table = original(registered)
        ours = {
            **TABLE,
            **scan_decompositions(),
            **pointwise_decompositions(),
            **linear_ce_decompositions(),
            **searchsorted_decompositions(),
            **stack_decompositions(),
        }
        table.update({op: fn for op, fn in ours.items() if op not in registered})
        # in place of the exporter's own function (export_fake_quantize.py)
        table.update(fake_quantize_decompositions())
        return table

    _decomp.create_onnx_friendly_decomposition_table = with_ours
    try:
        yield
    finally:
        _decomp.create_onnx_friendly_decomposition_table = original
