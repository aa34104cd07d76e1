"""Later sizes of a batch signature built from one symbolic export, specialized
(``ortrain/length_family.py``): the specialized forward equals a static export of that
size node for node and in value; training through it equals eager's step by step; a size
outside the traced range, and a specialized graph that disagrees with eager, are
exported at their own sizes."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortrain import ORTTrainer, TrainerOptions
from ortrain.length_family import NotSpecialized, evaluate, varying_axes

V, H = 40, 16


class _Causal(nn.Module):
    """A small causal LM (token and position embeddings, causal attention, a head);
    ``branch``: another computation above that many tokens (a forward that branches on
    the length)."""

    def __init__(self, branch: int | None = None):
        super().__init__()
        self.tok = nn.Embedding(V, H)
        self.pos = nn.Embedding(64, H)
        self.qkv = nn.Linear(H, 3 * H)
        self.out = nn.Linear(H, V)
        self.branch = branch

    def forward(self, input_ids, labels):
        t = input_ids.shape[1]
        x = self.tok(input_ids) + self.pos(torch.arange(t))
        q, k, v = self.qkv(x).view(x.shape[0], t, 3, 2, H // 2).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + y.transpose(1, 2).reshape(x.shape[0], t, H)
        if self.branch is not None and t > self.branch:
            x = torch.tanh(x)
        return F.cross_entropy(self.out(x).flatten(0, 1), labels.flatten())


def _batch(length: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (3, length), generator=g)
    return {"input_ids": ids, "labels": torch.roll(ids, -1, 1)}


def test_evaluate_and_varying_axes() -> None:
    assert evaluate("s0", {"s0": 7}) == 7
    assert evaluate("8*s0", {"s0": 7}) == 56
    assert evaluate("s0 + 1", {"s0": 7}) == 8
    assert evaluate("Max(1, s0 - 9)", {"s0": 7}) == 1
    assert evaluate("FloorDiv(s0, 2) + Mod(s0, 3)", {"s0": 7}) == 4
    with pytest.raises(NotSpecialized):
        evaluate("sqrt(s0)", {"s0": 7})
    with pytest.raises(NotSpecialized):
        evaluate("s1", {"s0": 7})
    assert varying_axes({"a": (3, 9), "b": (3,), "c": (2, 5)}, {"a": (3, 7), "b": (3,)}) == {
        "a": (1,)
    }


def test_a_specialized_export_is_the_static_export_of_its_size() -> None:
    import numpy as np
    import onnx_ir as ir
    import onnxruntime as ort

    from ortrain.export import ExportedForward, export_here
    from ortrain.length_family import specialize

    torch.manual_seed(0)
    model = _Causal().train()
    axes = {"input_ids": (1,), "labels": (1,)}
    sym = export_here(model, _batch(6, 0), True, None, True, axes)
    assert [str(d) for d in sym.model.graph.inputs[-1].shape] == ["3", "s0"] or any(
        not isinstance(d, int) for d in sym.model.graph.inputs[-1].shape
    )
    batch = _batch(11, 1)
    got = specialize(ExportedForward.from_wire(sym.to_wire()), batch)
    want = export_here(model, batch, True, None, True)
    ops = collections.Counter(n.op_type for n in got.model.graph)
    assert ops == collections.Counter(n.op_type for n in want.model.graph)
    assert [v.shape for v in got.model.graph.inputs] == [v.shape for v in want.model.graph.inputs]

    def run(m: ir.Model) -> list:
        data = ir.serde.serialize_model(m).SerializeToString()
        s = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        feeds = {n: p.detach().numpy() for n, p in model.named_parameters()}
        feeds.update({k: v.numpy() for k, v in batch.items()})
        return s.run(None, {i.name: feeds[i.name] for i in s.get_inputs()})

    for a, b in zip(run(got.model), run(want.model), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(NotSpecialized, match="input_ids"):  # a fixed size that differs
        specialize(ExportedForward.from_wire(want.to_wire()), _batch(12, 2))


def _train(model: nn.Module, lengths: list[int]) -> tuple[ORTTrainer, list[float]]:
    options = TrainerOptions(bucketing="off", eager_if_faster=False)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), options)
    losses = [float(trainer.train_step(**_batch(n, i))) for i, n in enumerate(lengths)]
    return trainer, losses


def _eager(model: nn.Module, lengths: list[int]) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = []
    for i, n in enumerate(lengths):
        opt.zero_grad()
        loss = model(**_batch(n, i))
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out


def _stages(trainer: ORTTrainer) -> list[str]:
    return [r.stage for r in trainer.build_log if r.stage in ("export", "specialize")]


def _check_like_eager(trainer: ORTTrainer, model, reference, losses, expected) -> None:
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    trainer.sync_to_module()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_later_sizes_start_from_one_symbolic_export_and_train_like_eager() -> None:
    """Lengths 6, 9, 13, 9, 17: the first is exported at its size, the second with the
    length symbolic (then specialized to its own), the third and fifth specialized from
    it, without an export; every step's loss and the parameters after equal eager
    training's (SGD: AdamW would turn float noise into steps of its rate)."""
    torch.manual_seed(0)
    model = _Causal()
    reference = copy.deepcopy(model)
    lengths = [6, 9, 13, 9, 17]
    trainer, losses = _train(model, lengths)
    _check_like_eager(trainer, model, reference, losses, _eager(reference, lengths))
    assert trainer.build_count == 4
    assert _stages(trainer) == ["export", "export", "specialize", "specialize", "specialize"]
    (family,) = trainer._program.graphs.families.values()
    assert family.axes == {"input_ids": (1,), "labels": (1,)} and family.wire is not None


def test_a_size_beyond_the_traced_branch_is_exported_at_its_own() -> None:
    """A forward that takes another path above 8 tokens: traced at 6 the length's range
    ends at 8, so 7 is specialized and 12 exported at its own size (its branch taken)."""
    torch.manual_seed(0)
    model = _Causal(branch=8)
    reference = copy.deepcopy(model)
    lengths = [5, 6, 7, 12]
    trainer, losses = _train(model, lengths)
    _check_like_eager(trainer, model, reference, losses, _eager(reference, lengths))
    assert _stages(trainer) == ["export", "export", "specialize", "specialize", "export"]


def test_a_specialized_graph_that_disagrees_is_exported_at_its_own_sizes(monkeypatch) -> None:
    """A specialized forward made wrong on purpose (its loss scaled): its first step's
    check against eager catches it, the graph is built from its own export, the
    signature's later sizes too; training stays equal to eager."""
    import ortrain.length_family as family_module

    real = family_module.specialize

    def wrong(ex, batch):
        out = real(ex, batch)
        graph = out.model.graph
        for node in graph:  # the loss's producer: its output times 2
            if node.outputs[0] is graph.outputs[0]:
                import onnx_ir as ir

                two = ir.Value(name="two", shape=ir.Shape([]), type=graph.outputs[0].type)
                two.const_value = ir.tensor(2.0, dtype=ir.DataType.FLOAT)
                graph.initializers["two"] = two
                old = node.outputs[0]
                mul = ir.node("Mul", [old, two])
                graph.append(mul)
                graph.outputs[0] = mul.outputs[0]
                mul.outputs[0].name, old.name = old.name, old.name + "_half"
                mul.outputs[0].shape, mul.outputs[0].type = old.shape, old.type
                break
        return out

    monkeypatch.setattr(family_module, "specialize", wrong)
    torch.manual_seed(0)
    model = _Causal()
    reference = copy.deepcopy(model)
    lengths = [6, 9, 13, 17]
    with pytest.warns(UserWarning, match="symbolic export"):
        trainer, losses = _train(model, lengths)
    _check_like_eager(trainer, model, reference, losses, _eager(reference, lengths))
    assert "specialize" in _stages(trainer) and _stages(trainer)[-2:] == ["export", "export"]
    (family,) = trainer._program.graphs.families.values()
    assert family.failed and family.wire is None
