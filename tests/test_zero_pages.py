"""Zero buffers that take memory only when written (``runtime/zero_pages.py``): a ZeRO
rank's optimizer-state and gradient shards, made with the trainer and first written at
the first update and backward, are not resident before (ZeRO-3's planning step holds
whole parameters then), and nothing that merely zeroes or checks them faults them in."""

from __future__ import annotations

import torch

from ortrain.core.optimizer_spec import GroupSpec, OptimizerSpec
from ortrain.runtime.training_state import TrainingState
from ortrain.runtime.zero_pages import lazy_zeros
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
