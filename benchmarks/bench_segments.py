"""Models that train as compiled segments (ortrain/segments): step time against eager.

Each model mixes parts that compile with a part that does not, so ``ORTTrainer`` trains it
as compiled segments inside torch autograd with eager PyTorch for the rest (the whole-model
graph would be refused or would disagree with eager on its first step):

gpt2-masked    GPT-2 (4 layers, 256 wide, seq 128) with a cross-entropy over the positions
               a boolean mask selects (``logits[labels != -100]``: a data-dependent shape
               the graphs cannot have): the transformer and the LM head compile, the loss
               runs in eager
encoder-ctc    a convolutional front and a 4-layer transformer encoder trained with CTC
               (``ctc_loss`` has data-dependent shapes the exporter refuses): the front and
               the encoder compile, the CTC loss in eager
mlm-selected   a BERT encoder (4 layers, 256 wide, seq 128) whose MLM head runs on the
               positions the labels select (``hidden[labels != -100]``, about 15% of them,
               a count that changes every step): the encoder compiles, the head is called
               with a new row count each step, which runs in eager until a count has lost
               a build's time (``ortrain/ski_rental.py``; the graph-only backend builds and
               checks every count)
cnn-spectral   a residual CNN whose classifier is spectrally normalized (a no-grad power
               iteration through a 1-D MatMul): it trained as segments until both had
               rules / markers; it compiles whole now and stays as a CNN workload

Backends: eager PyTorch, ortrain as it comes (``eager_if_faster="auto"``, the default: a
graph whose step looks slower than eager's is timed against eager on its first steps, the
faster kept) and ortrain with every step on its graph (``eager_if_faster=False``).
Each (model, backend) runs in its own process with the same thread count: build, warm-up
steps (ortrain's first step holds its export, builds and checks against eager), then
timed AdamW steps. The table: the median step of each, eager / ortrain (above 1: ortrain
is faster), ortrain's first step, the share of its step in compiled graphs, and where the
default's steps ran; and the wall time of all steps, first and warm-up included (what a
run of that many steps waits for).

    PYTHONPATH=. python benchmarks/bench_segments.py --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("gpt2-masked", "encoder-ctc", "mlm-selected", "cnn-spectral")


class _Block(torch.nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.a = torch.nn.Conv2d(c, c, 3, padding=1)
        self.na = torch.nn.BatchNorm2d(c)
        self.b = torch.nn.Conv2d(c, c, 3, padding=1)
        self.nb = torch.nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.nb(self.b(F.relu(self.na(self.a(x))))))


class CnnSpectral(torch.nn.Module):
    def __init__(self, c: int = 64, classes: int = 100):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, c, 3, padding=1), torch.nn.ReLU())
        self.blocks = torch.nn.Sequential(*[_Block(c) for _ in range(4)])
        self.head = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(c, classes))

    def forward(self, x, y):
        h = self.blocks(self.stem(x)).mean((2, 3))
        return F.cross_entropy(self.head(h), y)


class EncoderCtc(torch.nn.Module):
    def __init__(self, d: int = 256, vocab: int = 64):
        super().__init__()
        self.front = torch.nn.Sequential(
            torch.nn.Conv1d(80, d, 5, stride=2, padding=2), torch.nn.GELU()
        )
        layer = torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.out = torch.nn.Linear(d, vocab)

    def forward(self, feats, targets):
        h = self.front(feats).transpose(1, 2)
        logp = self.out(self.encoder(h)).log_softmax(-1).transpose(0, 1)  # T, B, V
        n, t = feats.shape[0], logp.shape[0]
        lengths = torch.full((n,), t, dtype=torch.long)
        target_lengths = torch.full((n,), targets.shape[1], dtype=torch.long)
        return F.ctc_loss(logp, targets, lengths, target_lengths, zero_infinity=True)


class MlmSelected(torch.nn.Module):
    """An MLM whose head (and its vocabulary projection) runs on the masked rows only."""

    def __init__(self, vocab: int = 4096, d: int = 256):
        super().__init__()
        from transformers import BertConfig, BertModel

        cfg = BertConfig(
            vocab_size=vocab, hidden_size=d, num_hidden_layers=4, num_attention_heads=4,
            intermediate_size=4 * d, max_position_embeddings=128,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        self.bert = BertModel(cfg, add_pooling_layer=False)
        self.head = torch.nn.Sequential(
            torch.nn.Linear(d, d), torch.nn.GELU(), torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab)
        )

    def forward(self, input_ids, labels):
        h = self.bert(input_ids=input_ids).last_hidden_state
        picked = labels != -100
        return F.cross_entropy(self.head(h[picked]), labels[picked])


def masked(out, batch):
    labels = batch["labels"][:, 1:]
    keep = labels != -100
    return F.cross_entropy(out.logits[:, :-1][keep], labels[keep])


def workload(name: str, g: torch.Generator):
    """(model, batch maker, loss_fn)."""
    if name == "gpt2-masked":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=512, n_positions=128)
        ids = lambda: torch.randint(0, 512, (8, 128), generator=g)  # noqa: E731

        def batch():
            x = ids()
            labels = x.clone()
            labels[:, 96:] = -100  # a padded tail the loss skips
            return {"input_ids": x, "labels": labels}

        return GPT2LMHeadModel(cfg), batch, masked
    if name == "encoder-ctc":

        def batch():
            return {
                "feats": torch.randn(8, 80, 200, generator=g),
                "targets": torch.randint(1, 64, (8, 20), generator=g),
            }

        return EncoderCtc(), batch, None
    if name == "mlm-selected":

        def batch():
            x = torch.randint(0, 4096, (8, 128), generator=g)
            picked = torch.rand(8, 128, generator=g) < 0.15
            return {"input_ids": x, "labels": torch.where(picked, x, torch.full_like(x, -100))}

        return MlmSelected(), batch, None
    if name == "cnn-spectral":

        def batch():
            return {
                "x": torch.randn(32, 3, 32, 32, generator=g),
                "y": torch.randint(0, 100, (32,), generator=g),
            }

        return CnnSpectral(), batch, None
    raise SystemExit(f"unknown model {name!r}: {', '.join(MODELS)}")


def run_one(name: str, backend: str, steps: int, warmup: int, threads: int) -> dict:
    from ortrain import ORTTrainer, TrainerOptions
    from ortrain.export import find_loss

    warnings.simplefilter("ignore")
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model, batch, loss_fn = workload(name, g)
    model.train()
    batches = [batch() for _ in range(warmup + steps)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    trainer = None
    if backend == "torch":

        def step(b):
            opt.zero_grad()
            out = model(**b)
            loss = loss_fn(out, b) if loss_fn else find_loss(out)
            loss.backward()
            opt.step()
            return loss.item()
    else:
        options = TrainerOptions(intra_op_threads=threads)
        if backend == "ortrain-graph":
            options = TrainerOptions(intra_op_threads=threads, eager_if_faster=False)
        trainer = ORTTrainer(model, opt, options, loss_fn=loss_fn)

        def step(b):
            return trainer.train_step(**b).item()

    times = []
    for b in batches:
        t = time.perf_counter()
        step(b)
        times.append(time.perf_counter() - t)
    result = {
        "first_s": times[0],
        "median_ms": 1e3 * statistics.median(times[warmup:]),
        "total_s": sum(times),
    }
    if trainer is not None:
        seg = trainer.segments
        result["segmented"] = seg is not None
        if seg is None and backend == "ortrain":
            said = trainer.speed_choices
            result["choice"] = (
                "eager (trial)"
                if "runs in eager" in said
                else "graph (no trial)"
                if "no trial" in said
                else "graph (trial)"
                if said
                else "graph"
            )
        if seg is not None and seg.model is not None:
            result["compiled"] = seg.model.compiled
            result["compiled_share"] = seg.model.compiled_seconds() / max(seg.step_seconds, 1e-9)
            calls = getattr(seg.model, "eager_calls", lambda n: 0)
            result["rented"] = sum(calls(n) for n in seg.model.compiled)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "BACKEND"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(run_one(*args.child, args.steps, args.warmup, args.threads)))
        return 0
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from hardware import cpu_description

    print("| model | eager ms | ortrain ms | eager / ortrain | first step | in graphs "
          "| where it ran | graph only ms | eager / graph only "
          "| all steps s: eager / ortrain / graph only |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    rows = []
    for name in args.models.split(","):
        row = {"model": name}
        for backend in ("torch", "ortrain", "ortrain-graph"):
            cmd = [sys.executable, __file__, "--child", name, backend, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--threads", str(args.threads)]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
            if done.returncode != 0:
                row[backend] = {"error": (done.stderr.strip().splitlines() or ["?"])[-1][:120]}
            else:
                row[backend] = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(_line(row), flush=True)
    print(f"\n{args.steps} timed AdamW steps after {args.warmup} warm-up, {args.threads} "
          f"threads; {cpu_description()}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def _line(row: dict) -> str:
    t, o, a = row["torch"], row["ortrain"], row["ortrain-graph"]
    if "error" in t or "error" in o or "error" in a:
        errors = " | ".join(r.get("error", "") for r in (t, o, a))
        return f"| {row['model']} | {errors} | | | | | | |"
    ratio = t["median_ms"] / o["median_ms"]
    share = f"{o['compiled_share']:.0%}" if "compiled_share" in o else "whole graph"
    choice = o.get("choice", "segments")
    if o.get("rented"):
        choice += f", {o['rented']} call(s) of new signatures in eager"
    return (f"| {row['model']} | {t['median_ms']:.1f} | {o['median_ms']:.1f} | {ratio:.2f}x "
            f"| {o['first_s']:.1f} s | {share} | {choice} | {a['median_ms']:.1f} "
            f"| {t['median_ms'] / a['median_ms']:.2f}x "
            f"| {t['total_s']:.1f} / {o['total_s']:.1f} / {a['total_s']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
