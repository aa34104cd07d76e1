"""A buffer a forward builds anew at another shape on its first call only (a cache sized
to the input: ConViT's ``rel_indices``, a positions table) no longer keeps its module out
of the graph: ortrain builds it in the training process before the export, as eager's
first step does, and the graph reads it like any buffer (``EagerSide._build_lazy_buffers``).
A buffer reshaped on every call still runs its module in eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ortrain import ORTTrainer, TrainerOptions


class _LazyTable(torch.nn.Module):
    """A per-position scale table, sized on the first call to the sequence length."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("table", torch.zeros(1, 1), persistent=False)
        self.lin = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if self.table.shape[0] != t:  # a cache: built once for the data's length
            pos = torch.arange(t, dtype=x.dtype)[:, None]
            self.table = torch.cos(pos / (1 + torch.arange(8, dtype=x.dtype)))
        h = torch.tanh(self.lin(x)) * self.table
        return F.cross_entropy(self.head(h.mean(1)), y)


class _Growing(torch.nn.Module):
    """A buffer assigned anew one longer on every call: state no graph can follow."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("seen", torch.zeros(1), persistent=False)
        self.lin = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.seen = torch.cat([self.seen, x.detach().mean()[None]])
        return F.cross_entropy(self.lin(x.mean(1)) * (1 + self.seen.mean()), y)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, 8, generator=g), torch.randint(0, 3, (4,), generator=g))] * n


def _train(make, steps: int = 3) -> tuple[ORTTrainer, torch.nn.Module, torch.nn.Module]:
    model, ref = make(), make()
    trainer = ORTTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions(graph_cache=False)
    )
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i, (x, y) in enumerate(_batches(steps)):
        want = ref(x, y)
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        got = trainer.train_step(x, y)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0, msg=f"step {i}")
    trainer.sync_to_module()
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)
    return trainer, model, ref


def test_a_cache_built_on_the_first_call_compiles_whole() -> None:
    trainer, model, ref = _train(_LazyTable)
    assert trainer.segments is None  # one graph, the table one of its buffers
    assert model.table.shape == ref.table.shape == (6, 8)
    torch.testing.assert_close(model.table, ref.table)
    # the graph reads the table (an input) rather than building it on every step
    (graph,) = trainer.train_graphs
    assert "Cos" not in {n.op_type for n in graph.graph}
    assert "table" in [v.name for v in graph.graph.inputs]


def test_a_buffer_reshaped_on_every_call_keeps_its_module_in_eager() -> None:
    with pytest.warns(UserWarning, match=r"buffer seen \(\[1\] -> \[2\]\)"):
        trainer, model, ref = _train(_Growing)
    assert trainer.segments is not None
    assert model.seen.shape == ref.seen.shape == (4,)
