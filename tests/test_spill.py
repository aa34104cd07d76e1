"""Copies kept in a file while a first-step check runs (``ortrain/spill.py``,
``verify.restoring(spill=True)``): bytes put back exactly, into the tensor's own memory,
for every dtype; what cannot go to a file is copied in memory as before."""

from __future__ import annotations

import pytest
import torch

from ortrain import spill, verify
from ortrain.spill import Spilled, SpillFile


@pytest.fixture
def small_spills(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spill, "SPILL_MIN_BYTES", 16)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.bool]
)
def test_bytes_put_back_are_the_bytes_kept(small_spills: None, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(37, 5, generator=g) * 100).to(dtype)
    u = torch.randn(300, generator=g).to(dtype)
    before_t, before_u = t.clone(), u.clone()
    pointer = t.data_ptr()
    f = SpillFile()
    kept_t, kept_u = f.keep(t), f.keep(u)
    assert isinstance(kept_t, Spilled) and isinstance(kept_u, Spilled)
    assert kept_u.offset == kept_t.nbytes  # one after the other
    t.fill_(0) if dtype == torch.bool else t.fill_(7)
    u.zero_()
    f.put_back(kept_u, u)
    f.put_back(kept_t, t)
    f.close()
    assert t.data_ptr() == pointer  # into its own storage
    assert torch.equal(t.view(torch.uint8), before_t.view(torch.uint8))
    assert torch.equal(u.view(torch.uint8), before_u.view(torch.uint8))


def test_nan_payloads_and_negative_zeros_come_back_bit_for_bit(small_spills: None) -> None:
    t = torch.tensor([float("nan"), -0.0, float("-inf"), 1e-45, 3.0] * 4)
    bits = t.view(torch.int32).clone()
    bits[0] = 0x7FC00123  # a NaN with a payload
    t.view(torch.int32).copy_(bits)
    f = SpillFile()
    kept = f.keep(t)
    assert kept is not None
    t.fill_(1.0)
    f.put_back(kept, t)
    f.close()
    assert torch.equal(t.view(torch.int32), bits)


def test_what_cannot_go_to_a_file_is_refused(small_spills: None) -> None:
    f = SpillFile()
    assert f.keep(torch.zeros(2)) is None  # under the size
    assert f.keep(torch.randn(8, 6).t()) is None  # not one run of bytes
    assert f.keep(torch.randn(8, 6, dtype=torch.complex64).conj()) is None  # a lazy conj
    assert f.keep(torch.randn(40, 40).to_sparse()) is None
    f.close()


def test_a_full_disk_leaves_the_copy_in_memory(small_spills: None, monkeypatch) -> None:
    import tempfile

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tempfile, "TemporaryFile", full)
    t = torch.randn(100)
    before = t.clone()
    with verify.restoring([t], spill=True):
        t.fill_(3.0)
    assert torch.equal(t, before)


class _Clones(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.Tensor.clone:
            self.sizes.append(args[0].numel())
        return func(*args, **(kwargs or {}))


def test_restoring_with_spill_copies_only_small_tensors_in_memory() -> None:
    big = torch.randn(1 << 19)  # 2 MiB: to the file
    small = torch.randn(10)  # in memory
    zeros = torch.zeros(1 << 19)  # all zeros: no copy at all, zeroed after
    resized = torch.randn(1 << 19)  # resized by the run, put back at its shape and values
    before = [big.clone(), small.clone(), resized.clone()]
    with _Clones() as clones, verify.restoring([big, small, zeros, resized], spill=True):
        big.mul_(2)
        small.add_(1)
        zeros.fill_(5)
        resized.resize_(3)
    assert clones.sizes == [10]
    assert torch.equal(big, before[0]) and torch.equal(small, before[1])
    assert not zeros.any()
    assert resized.shape == before[2].shape and torch.equal(resized, before[2])


def test_restoring_puts_back_even_when_the_run_raises() -> None:
    big = torch.randn(1 << 19)
    before = big.clone()
    with pytest.raises(RuntimeError, match="the run failed"):
        with verify.restoring([big], spill=True):
            big.zero_()
            raise RuntimeError("the run failed")
    assert torch.equal(big, before)
