"""GPT-2 pretraining: causal language modelling, AdamW, linear warmup + cosine decay.

    ortrain recipe gpt2 --preset tiny                  # CPU, minutes
    python -m ortrain.recipes.gpt2_pretrain --preset tiny      # the same
    ortrain recipe gpt2 --preset tiny --backend torch  # the same run in PyTorch eager
    torchrun --nproc_per_node 2 -m ortrain.recipes.gpt2_pretrain --preset tiny --zero 1

Reads top to bottom: config and presets, then ``train``: data (recipes/data.py), model,
optimizer and schedule, batches, and the shared loop (recipes/loop.py). Without --data
the corpus is this machine's Python standard library source.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

import torch

from ortrain.recipes import RecipeError, data, loop
from ortrain.recipes.config import TrainConfig, cli, field
from ortrain.recipes.processes import setup
from ortrain.recipes.schedules import warmup_cosine
from ortrain.recipes.task import Batch, Task, count_params


@dataclasses.dataclass
class Config(TrainConfig):
    """The defaults (here and in TrainConfig) are the tiny preset: ~0.7M parameters, 600
    steps of 16 x 128 tokens from 4 MB of stdlib source."""

    n_layer: int = field(2, "transformer blocks")
    n_head: int = field(4, "attention heads")
    n_embd: int = field(128, "hidden size")
    seq_len: int = field(128, "tokens per sequence (the context length)")
    dropout: float = field(0.0, "dropout on embeddings, residuals and attention")
    beta2: float = field(0.99, "AdamW beta2 (beta1 is 0.9)")
    min_lr_ratio: float = field(0.1, "where the cosine decay ends, as a fraction of --lr")
    lr: float = field(3e-3, "peak learning rate")
    weight_decay: float = field(0.1, "weight decay (on weight matrices and embeddings)")


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {},
    # GPT-2 small (124M) dimensions, nanoGPT's hyperparameters; for a GPU.
    "base": dict(
        n_layer=12, n_head=12, n_embd=768, seq_len=1024, vocab_size=50257,
        default_corpus_mb=1000.0, batch_size=8, grad_accum=8, steps=20000, lr=6e-4,
        warmup_steps=700, weight_decay=0.1, beta2=0.95, eval_interval=500, eval_batches=20,
        ckpt_interval=1000,
    ),
}  # fmt: skip


def train(cfg: Config) -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    env = setup(cfg, "gpt2")

    # --- data: corpus -> byte-level BPE -> documents joined by EOS, cut into rows
    with env.main_first():
        corpus = data.load_corpus(
            cfg.data, text_field=cfg.text_field, max_bytes=int(cfg.default_corpus_mb * 1e6)
        )
        tokenizer, how = data.get_tokenizer(cfg.tokenizer, corpus, "bpe", cfg.vocab_size)
        stream = data.encode(tokenizer, corpus)
    eos = tokenizer.token_to_id(data.GPT2_EOS)
    train_part, eval_part = stream.split(cfg.eval_fraction)
    train_seqs = data.causal_sequences(train_part, cfg.seq_len, eos)
    eval_seqs = data.causal_sequences(eval_part, cfg.seq_len, eos)
    need = cfg.batch_size * env.world
    if len(train_seqs) < need:
        raise RecipeError(
            f"too little text in {corpus.source}: {len(train_part):,} training tokens make "
            f"{len(train_seqs)} sequences of {cfg.seq_len}, one batch needs {need} (add text, "
            "or lower --batch-size / --seq-len)"
        )
    n_eval = min(cfg.eval_batches, len(eval_seqs) // cfg.batch_size)
    if n_eval < 1:
        raise RecipeError(
            f"too little text in {corpus.source} for one evaluation batch: the held-out "
            f"{len(eval_part):,} tokens make {len(eval_seqs)} sequences of {cfg.seq_len}, a "
            f"batch needs {cfg.batch_size} (add text, or raise --eval-fraction)"
        )
    sampler = data.EpochSampler(len(train_seqs), cfg.seed)

    def batch(step: int, micro: int) -> Batch:
        # Global micro-batch order is (step, micro, rank): this rank takes its own slice.
        k = (step * cfg.grad_accum + micro) * env.world + env.rank
        ids = train_seqs[sampler.take(k * cfg.batch_size, cfg.batch_size)]
        return {"input_ids": ids, "labels": ids}

    eval_batches = [
        {"input_ids": ids, "labels": ids}
        for ids in eval_seqs[: n_eval * cfg.batch_size].split(cfg.batch_size)
    ]

    # --- model: HF GPT-2 built from a config (eager attention exports with its dropout)
    torch.manual_seed(cfg.seed)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=tokenizer.get_vocab_size(),
            n_positions=cfg.seq_len,
            n_embd=cfg.n_embd,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            resid_pdrop=cfg.dropout,
            embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.dropout,
            bos_token_id=eos,
            eos_token_id=eos,
            attn_implementation="eager",
        )
    )

    # --- optimizer: AdamW, weight decay on matrices only; warmup + cosine decay
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, cfg.beta2),
    )  # fmt: skip
    schedule = warmup_cosine(cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)

    def eval_metrics(outputs: Mapping[str, torch.Tensor], batch: Batch) -> dict[str, float]:
        return {"loss": float(outputs["loss"])}

    params = count_params(model)

    def flops_per_token(seq_len: int) -> float:  # nanoGPT / PaLM appendix B
        return 6 * params + 12 * cfg.n_layer * cfg.n_embd * seq_len

    task = Task(
        name="gpt2",
        model=model,
        optimizer=optimizer,
        schedule=schedule,
        batch=batch,
        eval_batches=eval_batches,
        eval_metrics=eval_metrics,
        eval_keys=("loss",),
        flops_per_token=flops_per_token,
        tokenizer_json=tokenizer.to_str(),
        tokenizer_fingerprint=data.fingerprint(tokenizer),
        header=[
            *data.describe(corpus, tokenizer, how),
            f"data: {len(train_seqs):,} training sequences of {cfg.seq_len} tokens; "
            f"{n_eval} held-out batches",
            f"model: GPT-2 {cfg.n_layer}x{cfg.n_embd}, {params:,} parameters; "
            f"{cfg.batch_size * cfg.grad_accum * env.world * cfg.seq_len:,} tokens per step "
            f"({env.world} process{'es' if env.world > 1 else ''}); backend {cfg.backend}",
        ],
    )
    return loop.run(cfg, env, task)


main = cli("gpt2", train, Config, PRESETS, __doc__ or "")

if __name__ == "__main__":
    sys.exit(main())
