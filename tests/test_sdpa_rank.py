"""``F.scaled_dot_product_attention`` on inputs of rank 3 and 5+ compiles
(``ortrain/export_sdpa_rank.py``): losses and gradients equal eager's, masks of every
rank broadcast over the leading axes as torch broadcasts them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from ortrain import ORTTrainer, TrainerOptions

E = 8


def _cases(
    x: torch.Tensor, bool_mask: torch.Tensor, float_mask: torch.Tensor
) -> list[tuple[tuple[int, ...], dict]]:
    """(the leading shape of q, k and v, the call's keyword arguments); L = 5, S = 5."""
    return [
        ((2,), {}),  # single head [B, L, E]
        ((2,), {"is_causal": True}),
        ((2,), {"attn_mask": bool_mask}),  # [L, S]
        ((2,), {"attn_mask": x[:, :, :5].tanh()}),  # float [B, L, S], follows the input
        ((2, 3, 2), {"scale": 0.3}),  # [B, heads, windows, L, E]
        ((2, 3, 2), {"is_causal": True}),
        ((2, 3, 2), {"attn_mask": bool_mask[None, None]}),  # [1, 1, L, S]
        ((2, 1, 2, 1), {"attn_mask": float_mask}),  # rank 6, [2, 1, 1, 1, L, S]
    ]


class _Attend(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(E, E)
        self.k = torch.nn.Linear(E, E)
        self.v = torch.nn.Linear(E, 6)  # Dv != E
        mask = torch.rand(5, 5, generator=torch.Generator().manual_seed(3)) > 0.3
        self.register_buffer("bool_mask", mask | torch.eye(5, dtype=torch.bool))  # no empty row
        self.register_buffer("float_mask", torch.randn(2, 1, 1, 1, 5, 5))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        outs = {}
        for i, (lead, kw) in enumerate(_cases(x, self.bool_mask, self.float_mask)):
            h = x.reshape(2, *([1] * (len(lead) - 1)), 5, E).expand(*lead, 5, E)
            outs[f"out{i}"] = F.scaled_dot_product_attention(self.q(h), self.k(h), self.v(h), **kw)
        loss = sum((o * torch.linspace(-1, 1, o.shape[-1])).sum() for o in outs.values())
        return {"loss": loss, **outs}


def test_attention_of_rank_3_and_5_and_6_trains_like_eager() -> None:
    torch.manual_seed(0)
    model = _Attend()
    ref = copy.deepcopy(model)
    trainer = ORTTrainer(
        model, torch.optim.SGD(model.parameters(), lr=1.0), TrainerOptions(fallback="off")
    )
    x = torch.randn(2, 5, E)
    outputs = trainer.eval_step(x=x)  # the shapes and values of every call
    with torch.no_grad():
        for name, value in ref(x).items():
            assert outputs[name].shape == value.shape, name
            torch.testing.assert_close(outputs[name], value, rtol=1e-5, atol=1e-5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    got = trainer.train_step(x=x)
    assert trainer.segments is None  # one graph: no call ran in eager
    want = ref(x)
    want["loss"].backward()
    torch.testing.assert_close(got, want["loss"].detach(), rtol=1e-6, atol=1e-6)
    trainer.sync_to_module()
    # float32 sums of a loss of a few hundred terms, to their rounding at the largest
    # gradient of all (the key bias's is zero but for that rounding: softmax ignores it)
    atol = 2e-6 * max(float(p.grad.abs().max()) for p in ref.parameters())
    for name, p in model.named_parameters():
        grad = dict(ref.named_parameters())[name].grad
        torch.testing.assert_close(before[name] - p.detach(), grad, rtol=1e-5, atol=atol)


def test_grouped_query_attention_off_rank_4_is_refused_and_runs_in_eager() -> None:
    class Gqa(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(E, E)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.lin(x).expand(2, 2, 4, 5, E)  # 4 query heads
            kv = self.lin(x)[:, :, :2].expand(2, 2, 2, 5, E)  # 2 key heads
            return F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True).pow(2).mean()

    x = torch.randn(2, 1, 1, 5, E)
    model = Gqa()
    model(x)  # eager takes it
    opts = TrainerOptions(fallback="off")
    off = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), opts)
    with pytest.raises(Exception, match="enable_gqa=True"):
        off.train_step(x=x)
