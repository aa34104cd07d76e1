"""Zero buffers that take memory only when written (``runtime/zero_pages.py``): a ZeRO
rank's optimizer-state and gradient shards, made with the trainer and first written at
the first update and backward, are not resident before (ZeRO-3's planning step holds
whole parameters then), and nothing that merely zeroes or checks them faults them in;
``populate`` takes a buffer's pages in one call, its contents unchanged; ``release``
zeroes one and hands its whole pages back."""

from __future__ import annotations

import sys

import pytest
import torch

from ortrain.core.optimizer_spec import GroupSpec, OptimizerSpec
from ortrain.runtime import zero_pages
from ortrain.runtime.training_state import TrainingState
from ortrain.runtime.zero_pages import lazy_zeros, populate, release
from ortrain.verify import restoring

CPU = torch.device("cpu")
NUMEL = 32 * 2**20  # 128 MiB of float32
MIB = 2**20


def _resident(t: torch.Tensor) -> float:
    """MiB of the mapping holding ``t`` that are resident (``/proc/self/smaps``): what
    the process's other allocations do cannot move it."""
    ptr, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) / 1024
    raise AssertionError("no mapping holds the tensor")


def test_lazy_zeros_are_zeros_taken_only_where_written() -> None:
    t = lazy_zeros(NUMEL, CPU)
    assert t.dtype == torch.float32 and t.shape == (NUMEL,)
    assert _resident(t) < 1
    assert float(t.abs().max()) == 0.0  # reads as zeros, and reading takes no memory
    assert _resident(t) < 1
    t[: NUMEL // 2].fill_(1.0)
    assert 63 < _resident(t) < 66  # half of it written: half of it resident
    assert float(t.sum()) == NUMEL // 2
    view = t[-4:]
    del t  # a view keeps the mapping alive
    view.add_(2.0)
    assert view.tolist() == [2.0] * 4


def test_first_zeroing_leaves_pristine_gradients_untaken() -> None:
    module = torch.nn.Linear(4, 4)
    spec = OptimizerSpec("adamw", (GroupSpec(["weight", "bias"], False, 0.0, True),))
    state = TrainingState.of_module(module, spec, CPU)
    shard = lazy_zeros(NUMEL, CPU)
    state.shard_grads.append(shard)
    state.pristine_grads.add(id(shard))
    state.zero_grads()  # the first window: zeros already, left alone
    assert _resident(shard) < 1
    shard[:8].fill_(3.0)  # a backward wrote it
    state.zero_grads()  # every later window zeroes it
    assert not bool(shard.any())


def test_restoring_an_untouched_zero_buffer_does_not_take_it() -> None:
    t = lazy_zeros(NUMEL, CPU)
    with restoring([t]):
        pass
    assert _resident(t) < 1
    with restoring([t]):
        t[:8].fill_(5.0)  # written during the check: put back to zeros
    assert not bool(t.any())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(2) is Linux's")
def test_populate_takes_the_pages_in_one_call_and_keeps_the_contents() -> None:
    t = lazy_zeros(NUMEL, CPU)
    t[:4].copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    # measured as growth: a mapping made next to another may be merged with it
    before = _resident(t)
    if not populate(t):  # a kernel older than 5.14 refuses: nothing was taken
        assert not zero_pages._populating
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    assert 127 < _resident(t) - before <= 128  # every page now, none written by us
    assert t[:4].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert float(t[4:].abs().max()) == 0.0
    half = lazy_zeros(NUMEL, CPU)
    before = _resident(half)
    assert populate(half[: NUMEL // 2])  # a view: only its own pages
    assert 63 < _resident(half) - before < 65
    # a few pages come from the heap, resident already; a transposed view is not one range
    assert not populate(torch.empty(1024))
    assert not populate(torch.empty(2048, 2048).t())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(2) is Linux's")
def test_release_hands_back_the_pages_and_reads_zeros() -> None:
    """ZeRO-3's gradient shard after the first update where later ones run in the backward:
    its pages go, the elements in pages it shares with its neighbours (a slice of the
    mapping that does not start or end on a page) are zeroed instead, and all of it reads
    zeros and takes memory again only where written."""
    t = lazy_zeros(NUMEL, CPU)
    t.fill_(3.0)
    assert _resident(t) > 127
    part = t[1000 : NUMEL - 1000]  # starts and ends inside a page
    release(part)
    assert _resident(t) < 1
    assert t[:1000].eq(3.0).all() and t[NUMEL - 1000 :].eq(3.0).all()  # outside: kept
    assert float(part.abs().max()) == 0.0
    part[:8].add_(1.0)
    assert part[:8].tolist() == [1.0] * 8 and float(part[8:].abs().max()) == 0.0
    plain = torch.full((10,), 2.0)  # not a mapping: written with zeros
    release(plain)
    assert plain.tolist() == [0.0] * 10
    release(plain.fill_(2.0), zero_rest=False)  # nothing to hand back, nothing written
    assert plain.tolist() == [2.0] * 10


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(2) is Linux's")
def test_release_of_pieces_keeps_the_pages_they_share() -> None:
    """The first update before ZeRO-3's updates in the backward hands each parameter's
    piece of the gradient shard back as it passes it (``zero_rest=False``): only whole
    pages inside the piece go; the values in pages it shares with the next piece, not yet
    read, stay."""
    t = lazy_zeros(NUMEL, CPU)
    t.copy_(torch.arange(NUMEL, dtype=torch.float32))
    cut = 3 * 2**20 + 100  # not on a page
    release(t[:cut], zero_rest=False)
    assert _resident(t) < 128 - 11.9  # 12 MiB of its pages, less the one cut through
    edge = 3 * 2**20  # the page the cut goes through starts here: kept whole
    assert t[edge : cut + 5].tolist() == [float(i) for i in range(edge, cut + 5)]
    assert float(t[:edge].abs().max()) == 0.0  # whole pages inside: zeros again
