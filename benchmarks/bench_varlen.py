"""Variable-length training: PyTorch eager vs ortrain bucketed vs ortrain one graph per shape.

Real data comes in many lengths. The batches here are the GPT-2 recipe's corpus (the
Python standard library's sources, ``recipes/data.py``) cut into paragraphs (blocks
between blank lines: functions, classes, docstrings), tokenized with the recipe's BPE
tokenizer (trained on the corpus and cached), truncated to ``--max-len`` tokens; each
step draws ``--batch`` paragraphs at random and pads them to the longest with an
``attention_mask`` and ``-100`` labels (what ``DataCollatorForLanguageModeling`` gives).

Backends, one after the other in this process, on the same batches and initial weights:
  torch             eager;
  ortrain           ``TrainerOptions()`` (bucketing="auto": a few padded lengths);
  ortrain-pershape  ``TrainerOptions(bucketing="off")``: an export + build per length;
  ortrain-background  ``TrainerOptions(background_build=True)``: bucketed, the steps run
                    in eager PyTorch while a graph builds in a forked child.
  ortrain-everyshape  ``TrainerOptions(bucketing="off", eager_if_faster=False)``: every
                    length's graph built at its first batch (what a later length's build
                    costs: ``ortrain/length_family.py``).

Reported per backend: total wall time of all steps, builds included (the number a user
waits for), graphs built, the seconds the builds took, the median step without a build,
and the largest relative difference of a step's loss from eager's. The on-disk graph cache
(``ortrain/build_cache.py``) is off unless ``--graph-cache``: every build is a first run's
(with it, the per-shape run would reuse the bucketed run's graphs of equal length).

Usage::

    PYTHONPATH=. python benchmarks/bench_varlen.py                 # 200 steps, batch 8
    PYTHONPATH=. python benchmarks/bench_varlen.py --steps 24 --backends torch,ortrain
    PYTHONPATH=. python benchmarks/bench_varlen.py --steps 24 --no-mask   # packed, no mask
    PYTHONPATH=. python benchmarks/bench_varlen.py --steps 24 --no-mask --model nanogpt
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hardware import cpu_description

BACKENDS = ("torch", "ortrain", "ortrain-pershape", "ortrain-background", "ortrain-everyshape")
Batch = dict[str, torch.Tensor]


def paragraphs(max_mb: float, max_len: int, min_len: int) -> tuple[list[list[int]], int, int]:
    """Token ids of the recipe corpus's paragraphs; (paragraphs, vocab size, pad id)."""
    from ortrain.recipes import data

    corpus = data.load_corpus(None, max_bytes=int(max_mb * 2**20))
    tokenizer, _ = data.get_tokenizer(None, corpus, "bpe", 2048)
    texts = [p for t in corpus.texts for p in re.split(r"\n\s*\n", t) if p.strip()]
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    rows = [e.ids[:max_len] for e in encoded if len(e.ids) >= min_len]
    return rows, tokenizer.get_vocab_size(), tokenizer.token_to_id(data.GPT2_EOS)


def make_batches(rows: list[list[int]], steps: int, batch: int, pad: int, seed: int) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        pick = [rows[int(i)] for i in torch.randint(0, len(rows), (batch,), generator=g)]
        n = max(len(r) for r in pick)
        ids = torch.full((batch, n), pad, dtype=torch.long)
        mask = torch.zeros((batch, n), dtype=torch.long)
        for i, r in enumerate(pick):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        out.append(
            {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        )
    return out


def make_packed_batches(
    rows: list[list[int]], steps: int, batch: int, seed: int, nanogpt: bool = False
) -> list[Batch]:
    """Batches without a mask whose length changes every step (``--no-mask``): the same
    lengths as ``make_batches`` draws, each row a run of that many tokens of the corpus's
    paragraphs laid end to end (packed data): every token real, labels the ids (nanoGPT:
    ``idx`` and ``targets``, the next tokens, as its ``get_batch`` makes them)."""
    g = torch.Generator().manual_seed(seed)
    stream = torch.tensor([t for r in rows for t in r])
    out = []
    for _ in range(steps):
        pick = [rows[int(i)] for i in torch.randint(0, len(rows), (batch,), generator=g)]
        n = max(len(r) for r in pick)
        starts = torch.randint(0, len(stream) - n - 1, (batch,), generator=g)
        ids = torch.stack([stream[int(s) : int(s) + n] for s in starts])
        if nanogpt:
            nxt = torch.stack([stream[int(s) + 1 : int(s) + n + 1] for s in starts])
            out.append({"idx": ids, "targets": nxt})
        else:
            out.append({"input_ids": ids, "labels": ids.clone()})
    return out


class NanoGPT(torch.nn.Module):
    """``--model nanogpt``: nanoGPT's ``model.py`` shape, written by hand as its users
    write it: ``forward(idx, targets)`` returning ``(logits, loss)``, targets -1 skipped,
    causal attention through ``scaled_dot_product_attention``, a tied head."""

    def __init__(self, vocab: int, block_size: int, layers: int, width: int, heads: int):
        super().__init__()
        nn = torch.nn
        self.block_size, self.heads = block_size, heads
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block_size, width)
        self.blocks = nn.ModuleList(self._block(width) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    @staticmethod
    def _block(width: int) -> torch.nn.ModuleDict:
        nn = torch.nn
        return nn.ModuleDict({
            "ln_1": nn.LayerNorm(width), "c_attn": nn.Linear(width, 3 * width),
            "c_proj": nn.Linear(width, width), "ln_2": nn.LayerNorm(width),
            "c_fc": nn.Linear(width, 4 * width), "mlp_proj": nn.Linear(4 * width, width),
        })  # fmt: skip

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        import torch.nn.functional as F

        b, t = idx.shape
        assert t <= self.block_size, f"sequence {t} > block size {self.block_size}"
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            q, k, v = blk["c_attn"](blk["ln_1"](x)).chunk(3, dim=2)
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk["c_proj"](y.transpose(1, 2).reshape(b, t, -1))
            x = x + blk["mlp_proj"](F.gelu(blk["c_fc"](blk["ln_2"](x))))
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def make_model(args: argparse.Namespace, vocab: int) -> torch.nn.Module:
    if args.model == "nanogpt":
        torch.manual_seed(0)
        return NanoGPT(vocab, args.max_len, args.layers, args.hidden, args.heads)
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=vocab,
        n_positions=args.max_len, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="eager",
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def run(backend: str, model: torch.nn.Module, batches: list[Batch], lr: float) -> dict:
    """Train ``model`` on ``batches``; times of every step (builds included)."""
    from ortrain import ORTTrainer, TrainerOptions

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    trainer = None
    if backend != "torch":
        every = backend == "ortrain-everyshape"
        options = TrainerOptions(
            bucketing="off" if backend in ("ortrain-pershape", "ortrain-everyshape") else "auto",
            background_build=backend == "ortrain-background",
            eager_if_faster=False if every else "auto",
        )
        trainer = ORTTrainer(model, opt, options)
    losses, times, built, eager = [], [], [], []
    start = time.perf_counter()
    for batch in batches:
        t = time.perf_counter()
        if trainer is None:
            opt.zero_grad()
            out = model(**batch)
            loss = out[1] if isinstance(out, tuple) else out.loss
            loss.backward()
            opt.step()
        else:
            before, ran = trainer.build_count, trainer.eager_steps
            loss = trainer.train_step(**batch)
            # a step that waited for a build (in the background none waits: eager instead)
            built.append(trainer.build_count > before and not trainer.options.background_build)
            eager.append(trainer.eager_steps > ran)
        losses.append(loss.item())
        times.append(time.perf_counter() - t)
    total = time.perf_counter() - start
    # the median step on a graph: without a build (or, building in the background, in eager)
    waited = [b or e for b, e in zip(built, eager)] if trainer is not None else [False] * len(times)
    plain = [s for s, w in zip(times, waited) if not w]
    return {
        "total": total,
        "graphs": trainer.build_count if trainer else 0,
        "build_s": sum(s for s, b in zip(times, built) if b),
        "step_ms": 1e3 * statistics.median(plain) if plain else float("nan"),
        "eager_steps": sum(eager),
        "losses": losses,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--min-len", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--corpus-mb", type=float, default=4.0, help="the recipe corpus's cap")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--graph-cache", action="store_true", help="keep ortrain's on-disk cache on")
    p.add_argument("--no-mask", action="store_true", help="packed batches, no attention_mask")
    p.add_argument(
        "--model", choices=("gpt2", "nanogpt"), default="gpt2",
        help="transformers' GPT-2, or nanoGPT's hand-written shape (packed: --no-mask)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.model == "nanogpt" and not args.no_mask:
        p.error("--model nanogpt takes packed batches without a mask: add --no-mask")
    if not args.graph_cache:
        os.environ["ORTRAIN_GRAPH_CACHE"] = "0"
    if args.threads:
        torch.set_num_threads(args.threads)
    backends = args.backends.split(",")
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        p.error(f"unknown backends {sorted(unknown)}; choose from {', '.join(BACKENDS)}")

    rows, vocab, pad = paragraphs(args.corpus_mb, args.max_len, args.min_len)
    if args.no_mask:
        batches = make_packed_batches(
            rows, args.steps, args.batch, args.seed, args.model == "nanogpt"
        )
    else:
        batches = make_batches(rows, args.steps, args.batch, pad, args.seed)
    ids = "idx" if args.model == "nanogpt" else "input_ids"
    lengths = [b[ids].shape[1] for b in batches]
    real = sum(int(b.get("attention_mask", b[ids] * 0 + 1).sum()) for b in batches)
    name = "nanoGPT" if args.model == "nanogpt" else "GPT-2"
    print(
        f"{name} {args.layers} layers x {args.hidden}, vocab {vocab}, batch {args.batch}, "
        f"{args.steps} steps{' without a mask (packed)' if args.no_mask else ''}; "
        f"{len(rows)} paragraphs of the recipe corpus; batch lengths "
        f"{min(lengths)}-{max(lengths)} (median {statistics.median(lengths):.0f}, "
        f"{len(set(lengths))} distinct); real tokens {real / (args.batch * sum(lengths)):.0%} "
        "of the batches' tokens"
    )
    initial = make_model(args, vocab)
    results = {}
    for backend in backends:
        results[backend] = run(backend, copy.deepcopy(initial), batches, args.lr)
        gc.collect()
    ref = results.get("torch")
    print()
    print(
        "| backend | total s (builds incl.) | vs eager | graphs | build s | eager steps | step ms "
        "| loss diff |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for backend, r in results.items():
        ratio = f"{r['total'] / ref['total']:.2f}x" if ref else "-"
        diff = "-"
        if ref and backend != "torch":
            diff = f"{max(abs(a - b) / abs(b) for a, b in zip(r['losses'], ref['losses'])):.1e}"
        print(
            f"| {backend} | {r['total']:.1f} | {ratio} | {r['graphs']} | {r['build_s']:.1f} | "
            f"{r['eager_steps']} | "
            f"{r['step_ms']:.0f} | {diff} |"
        )
    print(
        f"\npython {platform.python_version()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; {cpu_description()}"
    )


if __name__ == "__main__":
    main()
