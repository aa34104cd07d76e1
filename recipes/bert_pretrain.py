"""BERT pretraining: masked LM (+ next-sentence prediction), LAMB, warmup + polynomial decay,
phase 1 at a short sequence length, then phase 2 at a long one (the last --phase2-steps).

    ortrain recipe bert --preset tiny                  # CPU, minutes
    python -m ortrain.recipes.bert_pretrain --preset tiny      # the same
    ortrain recipe bert --preset tiny --data ./my_texts/ --steps 2000
    ortrain recipe bert --preset tiny --backend torch  # the same run in PyTorch eager

Reads top to bottom: config and presets, the batch builder (NSP pairs, then masking:
recipes/masking.py), then ``train``: data (recipes/data.py), model, optimizer and schedule,
and the shared loop (recipes/loop.py). Each phase restarts its own warmup and decay, the
optimizer state carries over (NVIDIA's BERT recipe). Evaluation always uses the same
held-out batches at the phase-1 length, so the curve stays comparable across phases.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

import torch

from ortrain.recipes import RecipeError, data, loop
from ortrain.recipes.config import TrainConfig, cli, field
from ortrain.recipes.masking import IGNORE_INDEX, mask_tokens
from ortrain.recipes.processes import setup
from ortrain.recipes.schedules import phased, warmup_poly
from ortrain.recipes.task import Batch, Task, count_params


@dataclasses.dataclass
class Config(TrainConfig):
    """The defaults (here and in TrainConfig) are the tiny preset: ~0.7M parameters, 500
    steps of 16 x 64 tokens then 100 of 16 x 128, from 4 MB of stdlib source."""

    layers: int = field(2, "transformer layers")
    heads: int = field(4, "attention heads")
    hidden: int = field(128, "hidden size (the feed-forward size is 4x)")
    seq_len: int = field(64, "phase-1 sequence length")
    phase2_seq_len: int = field(128, "phase-2 sequence length")
    phase2_steps: int = field(100, "steps of phase 2, the last of --steps (0: no phase 2)")
    phase2_batch_size: int | None = field(None, "phase-2 --batch-size ['none': phase 1's]")
    phase2_lr: float | None = field(None, "phase-2 peak learning rate ['none': --lr]")
    phase2_warmup_steps: int = field(10, "phase-2 warmup steps")
    poly_power: float = field(1.0, "power of the polynomial decay (1: linear)")
    nsp: bool = field(True, "next-sentence prediction (BertForPreTraining; else MaskedLM)")
    mlm_prob: float = field(0.15, "fraction of tokens selected for the masked LM")
    dropout: float = field(0.0, "dropout on hidden states and attention probabilities")
    lr: float = field(1e-2, "peak learning rate (LAMB)")


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {},
    # BERT-base dimensions; NVIDIA's LAMB phases (128 -> 512) scaled to a small batch.
    "base": dict(
        layers=12, heads=12, hidden=768, seq_len=128, phase2_seq_len=512, vocab_size=30522,
        default_corpus_mb=1000.0, batch_size=32, grad_accum=8, steps=20000,
        phase2_steps=2000, phase2_batch_size=8, lr=2e-3, phase2_lr=1e-3, warmup_steps=2000,
        phase2_warmup_steps=200, poly_power=0.5, dropout=0.1, eval_interval=500,
        eval_batches=20, ckpt_interval=1000,
    ),
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Specials:
    pad: int
    cls: int
    sep: int
    mask: int
    all: torch.Tensor  # every special token id
    random_ids: torch.Tensor  # the rest of the vocabulary: what random replacement draws


def make_batch(
    chunks: data.Chunks,
    rows: torch.Tensor,
    seq_len: int,
    sp: Specials,
    cfg: Config,
    g: torch.Generator,
) -> Batch:
    """[CLS] A [SEP] B [SEP] per row (or [CLS] text [SEP] without NSP), right-padded, then
    masked. NSP: A is the chunk's start up to a random cut; B is its true continuation
    (label 0) or, with probability 1/2, as many tokens from a chunk of another document
    (label 1)."""
    n = len(rows)
    ids = torch.full((n, seq_len), sp.pad, dtype=torch.long)
    types = torch.zeros(n, seq_len, dtype=torch.long)
    nsp_labels = torch.zeros(n, dtype=torch.long)
    lengths = torch.zeros(n, 1, dtype=torch.long)
    for r, c in enumerate(rows.tolist()):
        piece = chunks.ids[c, : chunks.lengths[c]]
        if cfg.nsp:
            cut = int(torch.randint(1, len(piece), (1,), generator=g))
            first, second = piece[:cut], piece[cut:]
            if float(torch.rand((), generator=g)) < 0.5:
                nsp_labels[r] = 1
                for _ in range(10):  # another document's text, where there is one
                    other = int(torch.randint(len(chunks), (1,), generator=g))
                    if chunks.doc[other] != chunks.doc[c]:
                        break
                second = chunks.ids[other, : min(len(second), int(chunks.lengths[other]))]
            seq = [sp.cls, *first.tolist(), sp.sep, *second.tolist(), sp.sep]
            types[r, len(first) + 2 : len(seq)] = 1
        else:
            seq = [sp.cls, *piece.tolist(), sp.sep]
        ids[r, : len(seq)] = torch.tensor(seq)
        lengths[r] = len(seq)
    attention = (torch.arange(seq_len) < lengths).long()
    maskable = attention.bool() & ~torch.isin(ids, sp.all)
    inputs, labels = mask_tokens(
        ids, maskable, mask_id=sp.mask, random_ids=sp.random_ids, generator=g, prob=cfg.mlm_prob
    )
    batch = {"input_ids": inputs, "attention_mask": attention, "token_type_ids": types,
             "labels": labels}  # fmt: skip
    if cfg.nsp:
        batch["next_sentence_label"] = nsp_labels
    return batch


def step_generator(seed: int, stream: int, k: int) -> torch.Generator:
    """The generator for micro-batch k of a stream (a phase, or evaluation): batches are a
    pure function of (seed, k), so a resumed run draws the same pairs and masks."""
    return torch.Generator().manual_seed((seed % 2**20) << 40 | (stream % 256) << 32 | k)


def train(cfg: Config) -> dict[str, Any]:
    from transformers import BertConfig, BertForMaskedLM, BertForPreTraining
    from transformers.utils import logging as hf_logging

    from ortrain.optim import Lamb

    hf_logging.set_verbosity_error()
    if not 0 <= cfg.phase2_steps < cfg.steps:
        raise RecipeError(
            f"--phase2-steps ({cfg.phase2_steps}) must be below --steps ({cfg.steps}): "
            "phase 1 comes first"
        )
    if not 0.0 < cfg.mlm_prob < 1.0:
        raise RecipeError(f"--mlm-prob must be in (0, 1), got {cfg.mlm_prob}")
    env = setup(cfg, "bert")

    # --- data: corpus -> WordPiece -> per-document chunks for each phase's length
    with env.main_first():
        corpus = data.load_corpus(
            cfg.data, text_field=cfg.text_field, max_bytes=int(cfg.default_corpus_mb * 1e6)
        )
        tokenizer, how = data.get_tokenizer(cfg.tokenizer, corpus, "wordpiece", cfg.vocab_size)
        stream = data.encode(tokenizer, corpus)
    vocab = tokenizer.get_vocab_size()
    special_ids = sorted({tokenizer.token_to_id(t) for t in data.BERT_SPECIALS})
    sp = Specials(
        pad=tokenizer.token_to_id("[PAD]"),
        cls=tokenizer.token_to_id("[CLS]"),
        sep=tokenizer.token_to_id("[SEP]"),
        mask=tokenizer.token_to_id("[MASK]"),
        all=torch.tensor(special_ids),
        random_ids=torch.tensor(sorted(set(range(vocab)) - set(special_ids))),
    )
    room = 3 if cfg.nsp else 2  # [CLS], [SEP] (and the middle [SEP])
    train_part, eval_part = stream.split(cfg.eval_fraction)
    phase1_steps = cfg.steps - cfg.phase2_steps
    phases = [(0, cfg.seq_len, cfg.batch_size)]  # (first step, sequence length, batch size)
    if cfg.phase2_steps:
        phases.append((phase1_steps, cfg.phase2_seq_len, cfg.phase2_batch_size or cfg.batch_size))
    min_len = 2 if cfg.nsp else 1
    phase_chunks = [data.document_chunks(train_part, n - room, min_len) for _, n, _ in phases]
    for (_, seq_len, batch_size), chunks in zip(phases, phase_chunks):
        if len(chunks) < batch_size * env.world:
            raise RecipeError(
                f"too little text in {corpus.source}: {len(train_part):,} training tokens make "
                f"{len(chunks)} sequences of {seq_len}, one batch needs "
                f"{batch_size * env.world} (add text, or lower --batch-size)"
            )
    samplers = [data.EpochSampler(len(c), cfg.seed + i) for i, c in enumerate(phase_chunks)]

    def batch(step: int, micro: int) -> Batch:
        i = 1 if cfg.phase2_steps and step >= phase1_steps else 0
        start, seq_len, batch_size = phases[i]
        # Global micro-batch order within a phase is (step, micro, rank).
        k = ((step - start) * cfg.grad_accum + micro) * env.world + env.rank
        rows = samplers[i].take(k * batch_size, batch_size)
        g = step_generator(cfg.seed, i, k)
        return make_batch(phase_chunks[i], rows, seq_len, sp, cfg, g)

    eval_chunks = data.document_chunks(eval_part, cfg.seq_len - room, min_len)
    n_eval = min(cfg.eval_batches, len(eval_chunks) // cfg.batch_size)
    if n_eval < 1:
        raise RecipeError(
            f"too little text in {corpus.source} for one evaluation batch: the held-out "
            f"{len(eval_part):,} tokens make {len(eval_chunks)} sequences of {cfg.seq_len}, a "
            f"batch needs {cfg.batch_size} (add text, or raise --eval-fraction)"
        )
    eval_batches = [
        make_batch(eval_chunks, torch.arange(j * cfg.batch_size, (j + 1) * cfg.batch_size),
                   cfg.seq_len, sp, cfg, step_generator(0, 255, j))
        for j in range(n_eval)
    ]  # fmt: skip

    # --- model: HF BERT built from a config (eager attention exports with its dropout)
    torch.manual_seed(cfg.seed)
    bert_config = BertConfig(
        vocab_size=vocab,
        hidden_size=cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        intermediate_size=4 * cfg.hidden,
        max_position_embeddings=max(n for _, n, _ in phases),
        hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.dropout,
        pad_token_id=sp.pad,
        attn_implementation="eager",
    )
    model = (BertForPreTraining if cfg.nsp else BertForMaskedLM)(bert_config)

    # --- optimizer: LAMB, no decay for biases and LayerNorm; per-phase warmup + poly decay
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "LayerNorm" in name else decay).append(p)
    optimizer = Lamb(
        [{"params": decay, "weight_decay": cfg.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
    )  # fmt: skip
    schedule = phased(
        warmup_poly(cfg.warmup_steps, phase1_steps, cfg.poly_power),
        phase1_steps,
        warmup_poly(cfg.phase2_warmup_steps, cfg.phase2_steps, cfg.poly_power),
        (cfg.phase2_lr or cfg.lr) / cfg.lr,
    )

    def eval_metrics(outputs: Mapping[str, torch.Tensor], batch: Batch) -> dict[str, float]:
        logits = outputs["prediction_logits" if cfg.nsp else "logits"]
        mlm = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            batch["labels"].reshape(-1),
            ignore_index=IGNORE_INDEX,
        )
        values = {"loss": float(outputs["loss"]), "mlm_loss": float(mlm)}
        if cfg.nsp:
            guess = outputs["seq_relationship_logits"].argmax(-1)
            values["nsp_acc"] = float((guess == batch["next_sentence_label"]).float().mean())
        return values

    params = count_params(model)

    def flops_per_token(seq_len: int) -> float:
        return 6 * params + 12 * cfg.layers * cfg.hidden * seq_len

    phase_text = " then ".join(
        f"{(phases[i + 1][0] if i + 1 < len(phases) else cfg.steps) - s} steps at {b}x{n}"
        for i, (s, n, b) in enumerate(phases)
    )
    sizes = ", ".join(f"{len(c):,} sequences of {n}" for c, (_, n, _) in zip(phase_chunks, phases))
    task = Task(
        name="bert",
        model=model,
        optimizer=optimizer,
        schedule=schedule,
        batch=batch,
        eval_batches=eval_batches,
        eval_metrics=eval_metrics,
        eval_keys=("loss", "mlm_loss", "nsp_acc") if cfg.nsp else ("loss", "mlm_loss"),
        flops_per_token=flops_per_token,
        tokenizer_json=tokenizer.to_str(),
        tokenizer_fingerprint=data.fingerprint(tokenizer),
        ppl_key="mlm_loss",
        header=[
            *data.describe(corpus, tokenizer, how),
            f"data: {sizes} for training; {n_eval} held-out batches at {cfg.seq_len}",
            f"model: {type(model).__name__} {cfg.layers}x{cfg.hidden}, {params:,} parameters; "
            f"{phase_text} per process ({env.world} process{'es' if env.world > 1 else ''}, "
            f"grad accumulation {cfg.grad_accum}); backend {cfg.backend}",
        ],
    )
    return loop.run(cfg, env, task)


main = cli("bert", train, Config, PRESETS, __doc__ or "")

if __name__ == "__main__":
    sys.exit(main())
