"""ZeRO-2/3's gradient buckets (``ortrain/distributed/sharded_grads.py``): contiguous
ranges of the flat layout that cover it once, closed past the bucket size, and never
across a repeated block's edge (a block's backward opens only its own buckets)."""

from __future__ import annotations

import itertools

import pytest
import torch

from ortrain.distributed.sharded_grads import block_of, make_buckets
from ortrain.runtime.flat_layout import FlatLayout

pytestmark = pytest.mark.unit


class _Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)


class _Stack(torch.nn.Module):
    def __init__(self, width: int = 8, depth: int = 5) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, width)
        self.layers = torch.nn.ModuleList(_Block(width) for _ in range(depth))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, 3)


def _layout(model: torch.nn.Module) -> FlatLayout:
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return FlatLayout.build(shapes, align=16, world_size=3)


@pytest.mark.parametrize("numel", [1, 50, 300, 700, 10**6])
def test_buckets_cover_the_layout_and_stop_at_block_edges(numel: int):
    model = _Stack()
    layout = _layout(model)
    groups = block_of(model, layout.names)
    assert groups["layers.2.up.weight"] == "layers.2" and groups["embed.weight"] == ""
    buckets = make_buckets(layout, numel, groups=groups)
    # contiguous, in layout order, the whole layout once
    assert buckets[0].start == 0 and buckets[-1].stop == layout.numel
    assert all(a.stop == b.start for a, b in itertools.pairwise(buckets))
    assert [n for b in buckets for n in b.names] == layout.names
    for b in buckets:
        assert len({groups[n] for n in b.names}) == 1, b.names  # one block or none
    entries = {e.name: e for e in layout.entries}
    for b in buckets:  # made from the end: closed at the first boundary past the size
        if len(b.names) > 1:  # (or at a block's edge)
            assert b.stop - entries[b.names[1]].offset < numel
        big = [n for n in b.names if entries[n].stop - entries[n].offset >= numel]
        assert not big or b.names == tuple(big)  # its gradient is the bucket: no copy
    # a block's buckets hold exactly its parameters' stretch of the layout
    for k in range(5):
        mine = [b for b in buckets if groups[b.names[0]] == f"layers.{k}"]
        names = [n for b in mine for n in b.names]
        assert names == [n for n in layout.names if n.startswith(f"layers.{k}.")]
    # without groups a large bucket reaches across blocks (what the groups prevent)
    if numel >= 700:
        assert any(
            len({block_of(model, b.names)[n] for n in b.names}) > 1
            for b in make_buckets(layout, numel)
        )


def test_the_outermost_repeated_block_is_the_group():
    inner = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(2)])
    outer = torch.nn.ModuleList(
        torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(2)]) for _ in range(3)
    )
    model = torch.nn.ModuleDict({"inner": inner, "outer": outer})
    names = [n for n, _ in model.named_parameters()]
    groups = block_of(model, names)
    assert groups["outer.1.0.weight"] == "outer.1"  # not "outer.1.0", a block inside it
    assert groups["inner.0.bias"] == "inner.0"


def test_a_bucket_taken_without_zeros_is_zeroed_where_no_gradient_was_written():
    """A block's bucket handed to its backward graph unzeroed (the graph writes its
    outputs whole) goes out with zeros in the layout's alignment gaps and under the
    parameters this micro-step did not reach, the reached gradients untouched."""
    import types

    from ortrain.distributed.sharded_grads import ShardedGradients

    shapes = {"a.weight": (3, 5), "a.bias": (3,), "b.weight": (7,), "b.bias": (2,)}
    layout = FlatLayout.build(shapes, align=16)
    (bucket,) = make_buckets(layout, layout.numel)
    buf = torch.full((bucket.numel,), float("nan"))  # what the pool's memory held before
    entries = {e.name: e for e in layout.entries}
    reached = {"a.weight", "b.weight"}
    for n in reached:
        e = entries[n]
        buf[e.offset : e.stop] = torch.arange(e.numel, dtype=torch.float32) + 1
    fake = types.SimpleNamespace(_entries=entries, reached=reached)
    ShardedGradients._zero_unwritten(fake, bucket, buf)  # type: ignore[arg-type]
    for n, e in entries.items():
        want = torch.arange(e.numel, dtype=torch.float32) + 1 if n in reached else 0.0
        torch.testing.assert_close(buf[e.offset : e.stop], torch.as_tensor(want).expand(e.numel))
    written = torch.zeros(bucket.numel, dtype=torch.bool)
    for n in reached:
        written[entries[n].offset : entries[n].stop] = True
    assert layout.numel > sum(e.numel for e in entries.values())  # gaps exist
    assert (buf[~written] == 0).all()
