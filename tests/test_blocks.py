"""TrainerOptions(segments="blocks"): a model cut at its repeated blocks, each block a
compiled segment inside torch autograd, blocks of one structure sharing one graph and
session, the code around them in eager PyTorch (ortrain/segments/partition.py, case 5).
ZeRO-2 trains this way; test_distributed.py checks it across ranks."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions
from ortrain.segments.blocks import repeated_blocks


class _Residual(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 2 * dim)
        self.down = torch.nn.Linear(2 * dim, dim)

    def forward(self, h):
        return h + self.down(torch.nn.functional.silu(self.up(self.norm(h))))


class _Stack(torch.nn.Module):
    """A residual MLP stack with a head of another shape and a loss in its forward."""

    def __init__(self, depth: int = 4, dim: int = 16, classes: int = 5, smoothing: float = 0.05):
        super().__init__()
        torch.manual_seed(0)
        self.smoothing = smoothing
        self.embed = torch.nn.Linear(6, dim)
        self.blocks = torch.nn.Sequential(*[_Residual(dim) for _ in range(depth)])
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, x, y):
        logits = self.head(self.blocks(self.embed(x)))
        return torch.nn.functional.cross_entropy(logits, y, label_smoothing=self.smoothing)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(12, 6, generator=g), torch.randint(0, 5, (12,), generator=g)) for _ in range(n)
    ]


def _adamw(params):
    return torch.optim.AdamW(params, lr=3e-3)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _train_like_eager(model, batches: list, call, accumulation: int = 1, opt=_adamw):
    """Per-step losses (1e-5 relative) and final parameters against eager, with clipping,
    through ``call(module, batch) -> loss``."""
    ref = copy.deepcopy(model)
    opt_ref = opt(ref.parameters())
    options = TrainerOptions(
        segments="blocks",
        max_grad_norm=0.5,
        grad_accumulation_steps=accumulation,
        intra_op_threads=1,
    )
    trainer = ORTTrainer(model, opt(model.parameters()), options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # cut by choice, every block compiled: no warning
        for i, batch in enumerate(batches):
            want = call(ref, batch)
            (want / accumulation).backward()
            if (i + 1) % accumulation == 0:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
                opt_ref.step()
                opt_ref.zero_grad()
            got = (
                trainer.train_step(*batch)
                if isinstance(batch, tuple)
                else trainer.train_step(**batch)
            )
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0, msg=f"step {i}")
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    return trainer


def test_a_residual_stack_trains_like_eager_with_one_block_graph():
    trainer = _train_like_eager(_Stack(), _batches(6), lambda m, b: m(*b), accumulation=2)
    seg = trainer.segments
    assert seg is not None and seg.model is not None
    blocks = [f"blocks.{i}" for i in range(4)]
    assert sorted(seg.model.compiled) == sorted(["embed", "head", *blocks])
    assert seg.model.fallbacks == []
    # four blocks, one graph and one pair of sessions between them
    runners = {id(r) for b in blocks for r in seg.model.runners[b].values()}
    assert len(runners) == 1 and seg.model.builds == 3  # embed, the block, head
    kinds = {s.module: s.kind for s in trainer.program.segments}
    assert kinds["blocks"] == "cut" and all(kinds[b] == "compiled" for b in blocks)
    assert "compiled  blocks.3" in seg.explain()
    assert seg.pooled_losses == 0  # a label-smoothed loss: eager's own cross-entropy


def test_a_small_loss_is_routed_to_the_pool_on_the_first_step_only():
    trainer = _train_like_eager(_Stack(smoothing=0.0), _batches(3), lambda m, b: m(*b))
    seg = trainer.segments
    assert seg is not None
    # 12 x 5 logits: the heap's pages, nothing to gain; the mode costs every eager call
    assert seg.pooled_losses == 1 and not seg.route_losses


def test_bert_is_cut_at_its_layers_and_trains_like_eager(monkeypatch):
    from transformers import BertConfig, BertForSequenceClassification

    from ortrain.segments import pooled_loss

    monkeypatch.setattr(pooled_loss, "WORTH_BYTES", 0)  # its small loss pooled on every step

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    model = BertForSequenceClassification(cfg)
    g = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(3):
        ids = torch.randint(1, 96, (4, 12), generator=g)
        mask = torch.ones_like(ids)
        mask[1, 9:] = 0
        batches.append(
            {
                "input_ids": ids,
                "attention_mask": mask,
                "labels": torch.randint(0, 3, (4,), generator=g),
            }
        )
    # SGD: an embedding row's near-zero gradient is float noise, which AdamW's
    # normalisation would turn into lr-sized steps on either side
    trainer = _train_like_eager(model, batches, lambda m, b: m(**b).loss, opt=_sgd)
    seg = trainer.segments
    assert seg is not None and seg.model is not None
    layers = [f"bert.encoder.layer.{i}" for i in range(3)]
    assert all(name in seg.model.compiled for name in layers)
    assert len({id(r) for n in layers for r in seg.model.runners[n].values()}) == 1
    # the loss's buffers pooled (segments/pooled_loss.py), reused from the second step on
    assert seg.pooled_losses == 3
    assert seg.model.loss_pool is not None and seg.model.loss_pool.reused >= 4


def test_repeated_blocks_are_the_same_shaped_children_of_containers():
    stack = _Stack(depth=3)
    assert repeated_blocks(stack) == {"blocks.0", "blocks.1", "blocks.2"}
    odd = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 8), torch.nn.ReLU())
    assert repeated_blocks(odd) == set()  # other shapes; no parameters
    nested = torch.nn.ModuleList(
        [torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)) for _ in range(2)]
    )
    # the outer blocks and, inside each, two like Linears: the outer ones are cut at
    assert {"0", "1"} <= repeated_blocks(nested)


def test_segments_option_is_checked():
    with pytest.raises(ValueError, match="segments"):
        TrainerOptions(segments="layers")


def _live_storage_bytes() -> int:
    import gc

    gc.collect()
    seen = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and not o.is_meta:
            try:
                s = o.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
            except RuntimeError:  # an export's fake tensors (other tests'): no memory
                continue
    return sum(seen.values())


def test_segments_keep_nothing_of_a_step_once_it_is_done():
    """Each call's outputs are handed on to torch, not kept by the sessions: the memory
    held between steps does not grow with the steps taken (it grew by every segment
    output of every step while the sessions held every tensor ever bound)."""
    model = _Stack(depth=3, dim=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = ORTTrainer(model, opt, TrainerOptions(segments="blocks", intra_op_threads=1))
    batches = [(torch.randn(256, 6), torch.randint(0, 5, (256,))) for _ in range(6)]
    trainer.train_step(*batches[0])
    trainer.train_step(*batches[1])
    before = _live_storage_bytes()
    for batch in batches[2:]:
        trainer.train_step(*batch)
    assert _live_storage_bytes() == before  # (the process's: other tests' count too)
    runner = next(iter(trainer.segments.model.runners["blocks.0"].values()))
    assert runner.fwd.bound_outputs == {} and runner.bwd.bound_outputs == {}
