"""Python numbers given where an aten op takes a tensor (``torch.add(0.5, mask)``) are
wrapped as 0-dim tensors before the ONNX translation (``ortrain/export_scalar_operands.py``)."""

from __future__ import annotations

import copy

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions
from ortrain.export_scalar_operands import wrap_scalar_operands


class _NumbersFirst(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 6)

    def forward(self, x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        # Phi-3.5-MoE's routing multiplier: a number plus a bool mask times alpha
        m = torch.add(0.3333, h > 0, alpha=0.6667).type_as(h)
        a = torch.sub(1, h)
        b = torch.div(1.0, h * h + 3)
        c = torch.mul(3, h)
        n = torch.add(2, k)  # an int number and an int tensor stay int64
        keep = 1.0 - (k > 0).long()  # XLNet's input mask: aten.rsub.Scalar
        r = torch.rsub(h, 2.0, alpha=0.5)
        return (h * m + a * b + c * n + torch.pow(2.0, h.tanh()) + r * keep).sum()


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        {"x": torch.randn(3, 4, generator=g), "k": torch.randint(0, 3, (3, 6), generator=g)}
        for _ in range(n)
    ]


def test_numbers_first_compile_whole_and_train_like_eager() -> None:
    torch.manual_seed(0)
    model = _NumbersFirst()
    ref = copy.deepcopy(model)
    options = TrainerOptions(fallback="off")  # the export must not fail: no segments
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01), options)
    opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    for i, batch in enumerate(_batches(3)):
        want = ref(**batch)
        want.backward()
        opt.step()
        opt.zero_grad()
        got = trainer.train_step(**batch)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0, msg=f"step {i}")
    assert trainer.segments is None
    trainer.sync_to_module()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


class _Mixed(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            torch.add(0.25, x, alpha=2),
            torch.sub(3, x),
            torch.mul(True, x),
            torch.where(x > 0, x, 0.5),  # where.ScalarOther: a number argument, left alone
            1.0 - x,  # aten.rsub.Scalar: made rsub.Tensor
            torch.rsub(x, 2, alpha=3),
        )


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.float16, torch.float64])
def test_wrapped_numbers_promote_as_the_numbers_did(dtype: torch.dtype) -> None:
    """The wrapped graph gives eager's dtypes and values for every operand dtype: a 0-dim
    tensor of the number's dtype promotes as the number does."""
    x = (torch.randn(5) * 3).to(dtype)
    mixed = _Mixed()
    if dtype is torch.bool:  # torch refuses to subtract from a bool
        mixed.forward = lambda x: (torch.add(0.25, x, alpha=2), torch.mul(True, x))  # type: ignore[method-assign]
    program = torch.export.export(mixed, (x,))
    want = program.module()(x)
    wrapped = wrap_scalar_operands(program)
    assert wrapped == (2 if dtype is torch.bool else 5)
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.scalar_tensor.default) == wrapped
    assert torch.ops.aten.rsub.Scalar not in targets
    assert targets.count(torch.ops.aten.rsub.Tensor) == (0 if dtype is torch.bool else 2)
    got = program.module()(x)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=0, atol=0)
