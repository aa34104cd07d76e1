"""Masked-LM corruption (BERT, Devlin et al. 2019, section 3.1).

Each maskable token is selected with probability ``prob`` (15%), independently. A
selected token gets a label (its original id) and its input becomes:

1. ``[MASK]`` with probability 0.8,
2. a random token with probability 0.1 (drawn uniformly from the non-special ids),
3. itself with probability 0.1.

Tokens that are not maskable -- special tokens ([CLS], [SEP], [PAD], ...) and padding
positions -- are never selected, never changed and never labelled (label -100, which the
loss ignores). Masks are drawn anew for every batch from the given generator (dynamic
masking), so a batch's masks are a pure function of the generator's seed.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def mask_tokens(
    input_ids: torch.Tensor,
    maskable: torch.Tensor,
    *,
    mask_id: int,
    random_ids: torch.Tensor,
    generator: torch.Generator,
    prob: float = 0.15,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (corrupted inputs, labels) for ``input_ids`` (int64 [B, L]).

    ``maskable``: bool [B, L], False at special tokens and padding. ``random_ids``: the
    ids that the 10% random replacement draws from (the vocabulary without specials)."""
    if not 0.0 < prob < 1.0:
        raise ValueError(f"masking probability must be in (0, 1), got {prob}")
    shape = input_ids.shape
    selected = (torch.rand(shape, generator=generator) < prob) & maskable
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    action = torch.rand(shape, generator=generator)
    picks = torch.randint(len(random_ids), shape, generator=generator)
    inputs = input_ids.clone()
    inputs[selected & (action < 0.8)] = mask_id
    to_random = selected & (action >= 0.8) & (action < 0.9)
    inputs[to_random] = random_ids[picks[to_random]]
    return inputs, labels
