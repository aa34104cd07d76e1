"""``Comm.broadcast_tensors``: rank 0's start values to every rank without a copy of the
whole model. A contiguous tensor of a bucket's size or more (ZeRO's flat parameters) goes
as it is; the rest together, in buckets of about that size (before, one ``torch.cat`` of
everything: a second model-sized allocation at a ZeRO rank's start). Across ranks the
values are checked by ``tests/test_distributed.py`` (every rank starts from its own seed).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ortrain.distributed import comm as comm_mod
from ortrain.distributed.comm import Comm


@pytest.fixture
def comm(tmp_path: Path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)  # fmt: skip
    yield Comm(None, 60.0)
    dist.destroy_process_group()


def test_large_tensors_go_as_they_are_and_the_rest_in_buckets(comm, monkeypatch):
    monkeypatch.setattr(comm_mod, "BROADCAST_BUCKET_BYTES", 64)
    sent: list[torch.Tensor] = []
    original = Comm.broadcast

    def record(self: Comm, t: torch.Tensor) -> None:
        sent.append(t)
        original(self, t)

    monkeypatch.setattr(Comm, "broadcast", record)
    big = torch.randn(32)  # 128 bytes, contiguous
    strided = torch.randn(8, 8).t()  # 256 bytes, not contiguous: copied into a bucket
    small = [torch.randn(5) for _ in range(10)]  # 20 bytes each: buckets of four
    flags = torch.tensor([True, False, True])
    tensors = [big, strided, *small, flags]
    before = [t.clone() for t in tensors]
    comm.broadcast_tensors(tensors)
    assert sent[0] is big
    assert [(t.dtype, t.numel()) for t in sent[1:]] == [
        (torch.float32, 64), (torch.float32, 20), (torch.float32, 20), (torch.float32, 10),
        (torch.uint8, 3),
    ]  # fmt: skip
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t, b)
