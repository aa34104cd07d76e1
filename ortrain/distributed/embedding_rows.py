"""ZeRO-3: an embedding's forward gathers only the rows its batch reads.

A lookup reads a few rows of its table (a batch's tokens against a vocabulary of tens of
thousands), yet gathering the module's parameters brings the whole table to every rank:
GPT-2 medium's tied table is 196 MiB a rank takes into fresh memory for the embedding's
forward alone. Instead the ranks gather each other's token ids, and each adds the
elements of those rows it holds into one buffer of the rows (zeros elsewhere) that an
all-reduce completes: every rank gets the same exact values (a sum of one value and
zeros). The rows go into a table of the weight's shape whose other rows are never read
(on CPU its pages are taken only where written).

Only a plain ``nn.Embedding`` takes this way (a subclass may read its weight otherwise;
``max_norm`` renormalizes rows of the table in place), and only where the rows are fewer
than half the table: an all-reduce moves about twice the bytes of the broadcast that
gathers them whole. Every rank decides on the union of the ranks' ids, so all take the
same collectives.
"""

from __future__ import annotations

import torch

from ortrain.distributed.comm import Comm
from ortrain.runtime.zero_pages import lazy_zeros


def takes_rows(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward is a lookup of rows of its weight and nothing else."""
    return type(module) is torch.nn.Embedding and module.max_norm is None and not module.sparse


def union_of_ids(comm: Comm, ids: torch.Tensor, name: str) -> torch.Tensor:
    """The sorted distinct ids every rank's batch looks up (the same on every rank)."""
    mine = torch.unique(ids.detach().reshape(-1).to(torch.int64).cpu())
    every = comm.all_gather_rows(mine, mine.view(-1, 1), f"the rows {name} reads")
    return torch.unique(torch.cat([r for r, _ in every]))


def worth_rows(union: torch.Tensor, n_rows: int) -> bool:
    """Rows valid for the table (an id out of range gets the lookup's own error from the
    whole table) and fewer than half of it."""
    if union.numel() == 0 or int(union[0]) < 0 or int(union[-1]) >= n_rows:
        return False
    return 2 * union.numel() < n_rows


def rows_held(
    union: torch.Tensor,
    width: int,
    shard: torch.Tensor,
    table_lo: int,
    stretch_lo: int,
) -> torch.Tensor:
    """The rows ``union`` of a table of rows ``width`` wide starting at flat element
    ``table_lo``, with this rank's elements filled in (those of its shard, which starts at
    flat element ``stretch_lo``) and zeros elsewhere."""
    out = torch.zeros((union.numel(), width), dtype=shard.dtype, device=shard.device)
    n_rows = int(union[-1]) + 1 if union.numel() else 0
    # the table's elements this rank holds: [a, b), table-relative
    a = max(0, stretch_lo - table_lo)
    b = min(n_rows * width, stretch_lo + shard.numel() - table_lo)
    if a >= b:
        return out
    here = union.to(out.device)
    first_full, end_full = -(-a // width), b // width  # rows wholly inside [a, b)
    if first_full < end_full:
        at = table_lo + first_full * width - stretch_lo
        block = shard[at : at + (end_full - first_full) * width].view(-1, width)
        sel = (here >= first_full) & (here < end_full)
        out[sel] = block[here[sel] - first_full]
    # at most two rows cut by the shard's edges
    for row in {a // width, (b - 1) // width}:
        if first_full <= row < end_full:
            continue
        s, t = max(a, row * width), min(b, (row + 1) * width)
        k = int(torch.searchsorted(here, torch.tensor(row, device=here.device)))
        if s < t and k < here.numel() and int(here[k]) == row:
            out[k, s - row * width : t - row * width] = shard[
                table_lo + s - stretch_lo : table_lo + t - stretch_lo
            ]
    return out


def table_of_rows(union: torch.Tensor, rows: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of the weight's ``shape`` holding ``rows`` at ``union`` (its other rows are
    not read: zeros on CPU, taking no pages; uninitialised elsewhere)."""
    numel = shape[0] * shape[1]
    if rows.device.type == "cpu":
        table = lazy_zeros(numel, rows.device).view(shape)
    else:
        table = torch.empty(shape, dtype=rows.dtype, device=rows.device)
    table.index_copy_(0, union.to(rows.device), rows)
    return table
