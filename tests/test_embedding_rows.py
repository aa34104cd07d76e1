"""ZeRO-3's embedding rows (``ortrain/distributed/embedding_rows.py``): what each rank adds
of the rows a batch reads, summed over the ranks, is those rows of the table exactly,
wherever the shards' edges cut it; which modules and unions take the rows."""

from __future__ import annotations

import pytest
import torch

from ortrain.distributed.embedding_rows import rows_held, table_of_rows, takes_rows, worth_rows


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("offset", [0, 7, 130])
def test_the_ranks_rows_sum_to_the_tables_rows(world: int, offset: int) -> None:
    g = torch.Generator().manual_seed(world * 100 + offset)
    n_rows, width, after = 37, 11, 23  # a tensor before the table and one after it
    flat = torch.randn(offset + n_rows * width + after, generator=g)
    table = flat[offset : offset + n_rows * width].view(n_rows, width)
    per = -(-flat.numel() // world)  # shards of equal size, edges anywhere in a row
    union = torch.tensor([0, 3, 4, 17, 18, 30, 36])
    total = torch.zeros(union.numel(), width)
    for rank in range(world):
        lo = rank * per
        shard = flat[lo : lo + per]
        part = rows_held(union, width, shard, offset, lo)
        mine = torch.zeros_like(part)  # what this rank holds, element by element
        for k, row in enumerate(union.tolist()):
            for j in range(width):
                at = offset + row * width + j
                if lo <= at < lo + shard.numel():
                    mine[k, j] = flat[at]
        assert torch.equal(part, mine), rank
        total += part
    assert torch.equal(total, table[union])


def test_a_table_of_the_rows_reads_them_where_the_ids_look() -> None:
    rows = torch.arange(12.0).view(3, 4)
    union = torch.tensor([2, 5, 9])
    table = table_of_rows(union, rows, (10, 4))
    ids = torch.tensor([[9, 2], [5, 5]])
    assert torch.equal(
        torch.nn.functional.embedding(ids, table), rows[torch.tensor([[2, 0], [1, 1]])]
    )


def test_which_lookups_take_rows() -> None:
    assert takes_rows(torch.nn.Embedding(10, 4))
    assert takes_rows(torch.nn.Embedding(10, 4, padding_idx=0))
    assert not takes_rows(torch.nn.Embedding(10, 4, max_norm=1.0))  # renormalizes in place
    assert not takes_rows(torch.nn.Embedding(10, 4, sparse=True))

    class Scaled(torch.nn.Embedding):  # may read its weight otherwise
        pass

    assert not takes_rows(Scaled(10, 4))
    assert not takes_rows(torch.nn.Linear(4, 10))
    assert worth_rows(torch.tensor([0, 3, 7]), 10)
    assert not worth_rows(torch.tensor([0, 1, 2, 3, 4]), 10)  # half of it: gathered whole
    assert not worth_rows(torch.tensor([-1, 3]), 10)  # the lookup's own error, from the whole
    assert not worth_rows(torch.tensor([3, 10]), 10)
    assert not worth_rows(torch.tensor([], dtype=torch.int64), 10)
