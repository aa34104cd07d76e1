"""Zero-filled buffers whose memory is not resident until written.

A ZeRO rank makes its optimizer-state shard and gradient shard when the trainer is
built, but writes the state only at the first update and the gradients only at the
first backward. ``torch.zeros`` writes every page at once, so on CPU the rank holds
them through the first step's planning, where its parameters are still whole (ZeRO-3)
and the recording forward runs: that was the rank's peak. A private anonymous mapping
reads as zeros and takes a page only when it is first written.
"""

from __future__ import annotations

import mmap

import torch


def is_lazy(device: torch.device) -> bool:
    """Whether ``lazy_zeros`` on ``device`` takes its memory only as it is written."""
    return device.type == "cpu"


def lazy_zeros(numel: int, device: torch.device) -> torch.Tensor:
    """A float32 tensor of ``numel`` zeros; on CPU its pages are taken as they are
    first written (elsewhere: ``torch.zeros``)."""
    if not is_lazy(device) or numel == 0:
        return torch.zeros(numel, device=device)
    mapping = mmap.mmap(-1, numel * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # the tensor keeps the mapping alive (frombuffer holds a reference to its buffer)
    return torch.frombuffer(mapping, dtype=torch.float32, count=numel)
