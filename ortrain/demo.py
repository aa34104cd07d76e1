"""`ortrain demo`: train a small byte-level GPT-2 on built-in text, ortrain vs eager.

The corpus is the Python standard library's own source on this machine (nothing is
downloaded). Both backends start from the same weights and see the same batches.
"""

from __future__ import annotations

import copy
import sysconfig
import time
from pathlib import Path

import torch


def stdlib_bytes(limit: int = 2_000_000) -> torch.Tensor:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    if not chunks:
        raise RuntimeError(f"no Python sources found under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def run(steps: int = 60, batch: int = 8, seq: int = 128, compare: bool = True) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    from ortrain import ORTTrainer, TrainerOptions

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    data = stdlib_bytes()
    cfg = GPT2Config(
        vocab_size=256,
        n_positions=seq,
        n_embd=128,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(cfg)
    eager = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=3e-3, weight_decay=0.01)
    trainer = ORTTrainer(model, opt, TrainerOptions(seed=0))
    g = torch.Generator().manual_seed(0)
    print(
        f"corpus: {len(data):,} bytes of Python stdlib source; model: GPT-2 "
        f"{cfg.n_layer}x{cfg.n_embd}, {sum(p.numel() for p in model.parameters()):,} params"
    )
    t_ort = t_eager = 0.0
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq, (batch,), generator=g)
        ids = torch.stack([data[s : s + seq] for s in starts.tolist()])
        t = time.perf_counter()
        loss = trainer.train_step(input_ids=ids, labels=ids)
        if step > 0:  # step 0 includes export + graph build
            t_ort += time.perf_counter() - t
        else:
            print(f"built the training graph in {time.perf_counter() - t:.1f}s")
        line = f"step {step:3d}  ortrain loss {loss.item():.4f}"
        if compare:
            t = time.perf_counter()
            eager_opt.zero_grad()
            ref = eager(input_ids=ids, labels=ids).loss
            ref.backward()
            eager_opt.step()
            if step > 0:
                t_eager += time.perf_counter() - t
            line += f"  eager loss {ref.item():.4f}"
        if step % 10 == 0 or step == steps - 1:
            print(line, flush=True)
    tokens = (steps - 1) * batch * seq
    print(f"ortrain: {tokens / t_ort:,.0f} tokens/s", end="")
    if compare:
        print(f"  eager: {tokens / t_eager:,.0f} tokens/s  speedup {t_eager / t_ort:.2f}x")
    else:
        print()
