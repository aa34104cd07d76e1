"""Training-step benchmark: ortrain (ONNX Runtime graphs) vs PyTorch eager, side by side.

Each (workload, backend) pair runs in its own subprocess (this script re-invoked with
``--backend torch|ortrain --workload NAME --json PATH``) so that peak RSS
(``ru_maxrss``) belongs to that backend alone. The parent collects the results and
prints a Markdown table with the ratios, plus build times, memory detail and a check
that both backends saw the same first-step loss.

Per backend and workload, a run is:
  setup      seed, build the model (same seed -> same initial weights in both backends),
             AdamW(lr=1e-4, weight_decay=0.01), fixed synthetic batches;
  step 0     the first train step, timed on its own (for ortrain: export + graph passes +
             session compile + first run);
  warm-up    ``--warmup`` more steps, not timed into the result;
  timed      ``--steps`` steps; the median step time is the result.

Every step includes reading the loss back as a Python float (both backends), so each
timed step is complete when its timer stops.

Usage::

    PYTHONPATH=. python benchmarks/bench_train.py                   # gpt2-tiny, bert-tiny
    PYTHONPATH=. python benchmarks/bench_train.py --workload gpt2-small --steps 5
    PYTHONPATH=. python benchmarks/bench_train.py --json results.json --repeats 2
    PYTHONPATH=. python benchmarks/bench_train.py --backends torch,ortrain,ortrain-fp16   # + fp16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hardware import cpu_description

Batch = dict[str, torch.Tensor]
BACKENDS = (
    "torch",
    "ortrain",
    "ortrain-nopasses",  # optimize_graph=False, memory_plan=False: the plain gradient graph
    "ortrain-graphupdate",  # update_engine="graph": the update ONNX graph, not torch's kernels
    "ortrain-torchupdate",  # update_engine="torch": torch's kernels after the session, not
    # the update in the backward (which keeps no gradient buffers)
    "ortrain-mlas",  # cpu_gemm="onnxruntime": ONNX Runtime's GEMMs, not the BLAS custom op
    "ortrain-stdgrad",  # cpu_kernels="onnxruntime": backwards as standard ops, not fused
    "ortrain-noverify",  # verify=False: the first step not checked against eager
    "torch-fused",  # eager with AdamW(fused=True): the kernels ortrain's CPU update runs
    "ortrain-fp16",
    "ortrain-bf16",  # CUDA only
    "ortrain-cudagraph",  # CUDA only: whole-session CUDA graph replay
    "torch-amp-fp16",  # eager under torch.autocast, for the mixed-precision comparison
    "torch-amp-bf16",
)
DEFAULT_BACKENDS = ("torch", "ortrain")
LOSS_RTOL = 1e-3


# --------------------------------------------------------------------------- workloads
@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    batch: int
    seq: int
    vocab: int
    build: Callable[[Workload, float], torch.nn.Module]  # (workload, dropout) -> model
    make_batch: Callable[[Workload, torch.Generator], Batch]
    default: bool = True

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def _gpt2(layers: int, hidden: int, heads: int, positions: int) -> Callable:
    def build(w: Workload, dropout: float) -> torch.nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            n_layer=layers,
            n_embd=hidden,
            n_head=heads,
            vocab_size=w.vocab,
            n_positions=positions,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            attn_implementation="eager",
            bos_token_id=0,
            eos_token_id=0,
        )
        return GPT2LMHeadModel(cfg)

    return build


def _lm_batch(w: Workload, g: torch.Generator) -> Batch:
    ids = torch.randint(0, w.vocab, (w.batch, w.seq), generator=g)
    return {"input_ids": ids, "labels": ids}


def _bert_mlm(layers: int, hidden: int, heads: int, positions: int) -> Callable:
    def build(w: Workload, dropout: float) -> torch.nn.Module:
        from transformers import BertConfig, BertForMaskedLM

        cfg = BertConfig(
            vocab_size=w.vocab,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=4 * hidden,
            max_position_embeddings=positions,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
            attn_implementation="eager",
            pad_token_id=0,
        )
        return BertForMaskedLM(cfg)

    return build


def _llama(layers: int, hidden: int, heads: int, kv_heads: int, positions: int) -> Callable:
    def build(w: Workload, dropout: float) -> torch.nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=w.vocab,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            intermediate_size=hidden * 8 // 3 // 16 * 16,
            max_position_embeddings=positions,
            attention_dropout=dropout,
            bos_token_id=0,
            eos_token_id=0,
        )  # HF's default attention (sdpa), RMSNorm, rotary embeddings, SiLU-gated MLP
        return LlamaForCausalLM(cfg)

    return build


def _mlm_batch(w: Workload, g: torch.Generator) -> Batch:
    b, s = w.batch, w.seq
    ids = torch.randint(1, w.vocab, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    for row in range(b):  # right padding of varying length (0 .. s/4 tokens)
        pad = int(torch.randint(0, s // 4 + 1, (1,), generator=g))
        if pad:
            mask[row, s - pad :] = 0
            ids[row, s - pad :] = 0
    types = torch.zeros(b, s, dtype=torch.long)
    types[:, s // 2 :] = 1
    labels = torch.full((b, s), -100, dtype=torch.long)
    pick = (torch.rand(b, s, generator=g) < 0.15) & (mask == 1)
    pick[:, 1] = True  # at least one label per row
    labels[pick] = ids[pick]
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types, "labels": labels}


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload("gpt2-tiny", 8, 128, 8192, _gpt2(4, 256, 4, 128), _lm_batch),
        Workload("bert-tiny", 8, 128, 8192, _bert_mlm(4, 256, 4, 128), _mlm_batch),
        Workload("gpt2-small", 2, 256, 50257, _gpt2(12, 768, 12, 1024), _lm_batch, default=False),
        # Beyond the models: a Llama of gpt2-tiny's size (grouped-query attention)
        Workload("llama-tiny", 8, 128, 8192, _llama(4, 256, 4, 2, 128), _lm_batch, default=False),
        # GPU workloads (the CUDA issue's benchmark): BERT-base seq 128, GPT-2 small seq 512
        Workload(
            "bert-base", 32, 128, 30522, _bert_mlm(12, 768, 12, 512), _mlm_batch, default=False
        ),
        Workload(
            "gpt2-small-512", 8, 512, 50257, _gpt2(12, 768, 12, 1024), _lm_batch, default=False
        ),
    ]
}


# --------------------------------------------------------------------------- one backend
def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


@dataclasses.dataclass
class Setup:
    step: Callable[[Batch], float]  # one full training step; returns the loss
    info: dict[str, Any]  # backend extras filled in after the first step
    after_first: Callable[[], None]


def setup_torch(
    model: torch.nn.Module, opt: torch.optim.Optimizer, device: str, amp: str | None
) -> Setup:
    """Eager PyTorch; ``amp``: run under torch.autocast (fp16 with a GradScaler)."""
    model.train()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(amp or "")
    scaler = torch.amp.GradScaler(device, enabled=amp == "fp16")

    def step(batch: Batch) -> float:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.item()

    return Setup(step, {}, lambda: None)


def setup_ortrain(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    threads: int,
    precision: str | None,
    device: str = "cpu",
    cuda_graph: bool = False,
    passes: bool = True,
    update_engine: str = "auto",
    cpu_gemm: str = "auto",
    cpu_kernels: str = "auto",
    verify: bool = True,
) -> Setup:
    import ortrain.program_context as context_mod
    from ortrain import ORTTrainer, TrainerOptions

    info: dict[str, Any] = {"session_init_s": 0.0}
    make_session = context_mod.make_session

    def timed_make_session(*args: Any, **kwargs: Any) -> Any:  # instrumentation only
        t = time.perf_counter()
        try:
            return make_session(*args, **kwargs)
        finally:
            info["session_init_s"] += time.perf_counter() - t

    context_mod.make_session = timed_make_session
    options = TrainerOptions(
        intra_op_threads=threads,
        mixed_precision=precision,
        device=device,
        cuda_graph=cuda_graph,
        optimize_graph=passes,
        memory_plan=passes,
        update_engine=update_engine,
        cpu_gemm=cpu_gemm,
        cpu_kernels=cpu_kernels,
        verify=verify,
    )
    trainer = ORTTrainer(model, opt, options)

    def step(batch: Batch) -> float:
        loss = float(trainer.train_step(**batch))
        # steps eager_if_faster ran in eager PyTorch ("auto": only for a graph that looks
        # slower than eager): 0 where every step ran on the graph
        info["eager_steps"] = trainer.eager_steps
        return loss

    def after_first() -> None:
        context_mod.make_session = make_session
        stages: dict[str, float] = {}
        for r in trainer.build_log:
            stages[r.stage] = stages.get(r.stage, 0.0) + r.seconds
        info["build_stages_s"] = stages
        info["graph_nodes"] = {f"{r.graph}.{r.stage}": r.nodes_after for r in trainer.build_log}
        info["skipped_steps"] = trainer.skipped_steps

    return Setup(step, info, after_first)


@dataclasses.dataclass
class Trace:
    """Per-step measurements of a run of steps."""

    wall_s: list[float] = dataclasses.field(default_factory=list)
    cpu_s: list[float] = dataclasses.field(default_factory=list)  # process CPU, all threads
    minor_faults: list[int] = dataclasses.field(default_factory=list)
    loss: list[float] = dataclasses.field(default_factory=list)
    rss_mib: list[float] = dataclasses.field(default_factory=list)  # RSS after the step


def busy_cpu_seconds() -> float:
    """System-wide busy CPU time (all processes, all CPUs)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed_steps(step: Callable[[Batch], float], batches: list[Batch], start: int, n: int) -> Trace:
    """Run ``n`` steps over ``batches`` (cycled from index ``start``), timing each."""
    tr = Trace()
    for i in range(start, start + n):
        batch = batches[i % len(batches)]
        f0, c0 = minor_faults(), time.process_time()
        t0 = time.perf_counter()
        loss = step(batch)
        t1 = time.perf_counter()
        tr.cpu_s.append(time.process_time() - c0)
        tr.minor_faults.append(minor_faults() - f0)
        tr.wall_s.append(t1 - t0)
        tr.loss.append(loss)
        tr.rss_mib.append(rss_bytes() / 2**20)
    return tr


def wait_quiet(max_wait_s: float, busy_pct: float = 25.0) -> float:
    """Wait (up to ``max_wait_s``) until other processes leave the CPUs mostly idle.

    Returns the last system-wide CPU busy percentage sampled (over 2 s).
    """
    deadline = time.monotonic() + max_wait_s
    busy = psutil.cpu_percent(interval=2.0)
    while busy > busy_pct and time.monotonic() < deadline:
        busy = psutil.cpu_percent(interval=2.0)
    return busy


def device_used_bytes(device: str) -> int:
    """Memory in use on the CUDA device (all allocators: torch's and ONNX Runtime's
    arenas keep their peak reserved, so this after the steps is the run's peak)."""
    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def run_backend(args: argparse.Namespace) -> dict[str, Any]:
    w = WORKLOADS[args.workload]
    if args.batch is not None:
        w = dataclasses.replace(w, batch=args.batch)
    torch.set_num_threads(args.threads)
    _quiet_transformers()
    rss_start = rss_bytes()
    if args.device == "cuda":
        torch.cuda.init()
    device_start = device_used_bytes(args.device)

    # ---- setup (not timed)
    torch.manual_seed(args.seed)
    model = w.build(w, args.dropout)
    n_params = sum(p.numel() for p in model.parameters())
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    fused = args.backend == "torch-fused"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=fused or None)
    g = torch.Generator().manual_seed(args.seed + 1)
    batches = [w.make_batch(w, g) for _ in range(args.num_batches)]
    if args.backend.startswith("torch"):
        model.to(args.device)
        amp = args.backend.removeprefix("torch-amp-") if "amp" in args.backend else None
        s = setup_torch(model, opt, args.device, amp)
    else:
        precision = {"ortrain-fp16": "fp16", "ortrain-bf16": "bf16"}.get(args.backend)
        graph = args.backend == "ortrain-cudagraph"
        passes = args.backend != "ortrain-nopasses"
        engine = {"ortrain-graphupdate": "graph", "ortrain-torchupdate": "torch"}.get(
            args.backend, "auto"
        )
        gemm = "onnxruntime" if args.backend == "ortrain-mlas" else "auto"
        kernels = "onnxruntime" if args.backend == "ortrain-stdgrad" else "auto"
        s = setup_ortrain(
            model,
            opt,
            args.threads,
            precision,
            args.device,
            graph,
            passes,
            engine,
            gemm,
            kernels,
            verify=args.backend != "ortrain-noverify",
        )
    rss_setup = rss_bytes()

    # ---- step 0: first step (ortrain: export + compile + run)
    first = timed_steps(s.step, batches, 0, 1)
    s.after_first()
    peak_after_first = peak_rss_bytes()

    # ---- warm-up
    warm = timed_steps(s.step, batches, 1, args.warmup)
    rss_warm = rss_bytes()
    peak_warm = peak_rss_bytes()

    # ---- timed steps
    load_before = os.getloadavg()[0]
    busy0 = busy_cpu_seconds()
    timed = timed_steps(s.step, batches, 1 + args.warmup, args.steps)
    busy = busy_cpu_seconds() - busy0
    peak_end = peak_rss_bytes()

    median = statistics.median(timed.wall_s)
    device_peak = device_used_bytes(args.device) - device_start
    return {
        "device": args.device
        + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""),
        "device_peak_mib": device_peak / 2**20,
        "workload": w.name,
        "backend": args.backend,
        "batch": w.batch,
        "seq": w.seq,
        "params": n_params,
        "param_checksum": checksum,
        "threads": args.threads,
        "dropout": args.dropout,
        "first_step_s": first.wall_s[0],
        "median_step_s": median,
        "min_step_s": min(timed.wall_s),
        "median_cpu_step_s": statistics.median(timed.cpu_s),
        "tokens_per_s": w.tokens / median,
        # CPU seconds per wall second in the timed steps: ~threads when the run had the
        # CPUs to itself, less when other processes competed for them.
        "cpu_util": sum(timed.cpu_s) / sum(timed.wall_s),
        "loadavg_1m": [load_before, os.getloadavg()[0]],
        # CPUs kept busy by other processes during the timed steps (0 on a quiet machine).
        "other_cpus": max(busy - sum(timed.cpu_s), 0.0) / sum(timed.wall_s),
        "first_loss": first.loss[0],
        "rss_start_mib": rss_start / 2**20,
        "rss_setup_mib": rss_setup / 2**20,
        "peak_rss_after_first_mib": peak_after_first / 2**20,
        "rss_after_warmup_mib": rss_warm / 2**20,
        "peak_rss_after_warmup_mib": peak_warm / 2**20,
        "peak_rss_mib": peak_end / 2**20,
        "trace": {
            "first": dataclasses.asdict(first),
            "warmup": dataclasses.asdict(warm),
            "timed": dataclasses.asdict(timed),
        },
        **s.info,
    }


# --------------------------------------------------------------------------- driver
def child_command(args: argparse.Namespace, workload: str, backend: str, out: Path) -> list[str]:
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--backend", backend,
        "--workload", workload,
        "--json", str(out),
        "--warmup", str(args.warmup),
        "--steps", str(args.steps),
        "--threads", str(args.threads),
        "--dropout", str(args.dropout),
        "--seed", str(args.seed),
        "--num-batches", str(args.num_batches),
        "--device", args.device,
        *(["--batch", str(args.batch)] if args.batch is not None else []),
    ]  # fmt: skip


def run_child(
    args: argparse.Namespace, workload: str, backend: str, *, check: bool = True
) -> dict[str, Any] | None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = child_command(args, workload, backend, out)
        env = dict(os.environ)
        repo = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
        t = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            if not check:  # a probe that ran out of memory
                return None
            sys.stderr.write(proc.stdout + proc.stderr)
            raise SystemExit(f"{backend} / {workload} failed (exit {proc.returncode})")
        result = json.loads(out.read_text())
        result["process_s"] = time.perf_counter() - t
        return result


def contended(r: dict[str, Any]) -> bool:
    """Other processes took a noticeable share of the CPUs during the timed steps."""
    return r["other_cpus"] > 0.25 or r["cpu_util"] < 0.75 * r["threads"]


def better(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    """Of two repeats, keep the uncontended one, else the one with the lower median."""
    if a is None:
        return b
    if contended(a) != contended(b):
        return a if contended(b) else b
    return b if b["median_step_s"] < a["median_step_s"] else a


def source_state() -> dict[str, Any]:
    """The git commit and uncommitted changes of the code under test."""
    repo = Path(__file__).resolve().parents[1]

    def git(*cmd: str) -> str:
        try:
            out = subprocess.run(["git", *cmd], cwd=repo, capture_output=True, text=True)
        except OSError:
            return ""
        return out.stdout.rstrip()

    dirty = git("status", "--porcelain", "--", "ortrain", "graph_passes").splitlines()
    return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": [d[3:] for d in dirty]}


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def _ab_table(
    results: dict[str, dict[str, Any]],
    a_key: str,
    b_key: str,
    a_name: str,
    b_name: str,
    speedup: str,
    a_short: str,
    b_short: str,
    extra_heads: tuple[str, ...],
    extra: Callable[[dict[str, Any], dict[str, Any]], tuple[Any, ...]],
) -> list[str]:
    """Backend ``a_key`` against ``b_key`` per workload: step times, speedup (a / b),
    peak RSS and its ratio (b / a), plus ``extra`` columns; nothing where either is absent."""
    rows = [(n, r[a_key], r[b_key]) for n, r in results.items() if a_key in r and b_key in r]
    if not rows:
        return []
    heads = [f"{a_name} ms/step", f"{b_name} ms/step", speedup, f"{a_short} peak RSS MiB",
             f"{b_short} peak RSS MiB", "RSS ratio", *extra_heads]  # fmt: skip
    lines = ["", "| workload | " + " | ".join(heads) + " |", "|---" + "|---:" * len(heads) + "|"]
    for name, a, b in rows:
        cells = [
            f"{a['median_step_s'] * 1e3:.1f}",
            f"{b['median_step_s'] * 1e3:.1f}",
            f"{a['median_step_s'] / b['median_step_s']:.2f}x",
            f"{a['peak_rss_mib']:.0f}",
            f"{b['peak_rss_mib']:.0f}",
            f"{b['peak_rss_mib'] / a['peak_rss_mib']:.2f}",
            *(str(x) for x in extra(a, b)),
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _train_nodes(r: dict[str, Any]) -> int:
    """Nodes of the gradient graph after its last build pass."""
    train = [v for k, v in r.get("graph_nodes", {}).items() if k.startswith("train.")]
    return train[-1] if train else 0


def report(
    results: dict[str, dict[str, dict[str, Any]]], command: str, wall_s: float, src: dict[str, Any]
) -> str:
    lines = [
        "| workload | eager ms/step | ortrain ms/step | speedup | eager tok/s | ortrain tok/s "
        "| eager peak RSS MiB | ortrain peak RSS MiB | RSS ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        e, o = r["torch"], r["ortrain"]
        lines.append(
            f"| {name} | {e['median_step_s'] * 1e3:.1f} | {o['median_step_s'] * 1e3:.1f} "
            f"| {e['median_step_s'] / o['median_step_s']:.2f}x "
            f"| {e['tokens_per_s']:,.0f} | {o['tokens_per_s']:,.0f} "
            f"| {e['peak_rss_mib']:.0f} | {o['peak_rss_mib']:.0f} "
            f"| {o['peak_rss_mib'] / e['peak_rss_mib']:.2f} |"
        )
    lines += _ab_table(
        results, "ortrain-nopasses", "ortrain", "passes off", "passes on", "speedup from passes",
        "off", "on", ("nodes off", "nodes on"), lambda a, b: (_train_nodes(a), _train_nodes(b)),
    )  # fmt: skip
    lines += _ab_table(
        results, "ortrain-graphupdate", "ortrain", "update graph", "default update",
        "speedup from the update engine", "graph", "default", (), lambda a, b: (),
    )  # fmt: skip
    lines += _ab_table(
        results, "ortrain-torchupdate", "ortrain", "update after the session",
        "update in the backward", "speedup", "after", "in backward", (), lambda a, b: (),
    )  # fmt: skip
    lines += _ab_table(
        results, "ortrain-mlas", "ortrain", "ONNX Runtime GEMMs", "BLAS GEMM op",
        "speedup from the BLAS op", "MLAS", "BLAS", (), lambda a, b: (),
    )  # fmt: skip
    lines += _ab_table(
        results, "ortrain-stdgrad", "ortrain", "standard-op backwards", "fused CPU kernels",
        "speedup from the kernels", "std", "fused", (), lambda a, b: (),
    )  # fmt: skip
    lines += _ab_table(
        results, "torch-fused", "ortrain", "eager fused AdamW", "ortrain",
        "speedup vs eager with fused=True", "eager", "ortrain", (), lambda a, b: (),
    )  # fmt: skip
    lines += _ab_table(
        results, "ortrain", "ortrain-fp16", "ortrain fp32", "ortrain fp16", "fp16 speedup",
        "fp32", "fp16", ("fp16 skipped steps",), lambda a, b: (b.get("skipped_steps", 0),),
    )  # fmt: skip
    lines += [
        "",
        "speedup = eager / ortrain median step time (>1: ortrain faster); "
        "RSS ratio = ortrain / eager peak RSS (ru_maxrss after the timed steps).",
        "",
        "| workload | backend | first step s | ortrain build: export / passes / ORT init s "
        "| RSS after warm-up MiB | RSS growth MiB/step | min / max ms | CPU ms/step "
        "| CPU util | other procs' CPUs | minor faults/step warm-up → timed |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        for b in r:
            x = r[b]
            build = "-"
            if b.startswith("ortrain"):
                st = x["build_stages_s"]
                passes = sum(v for k, v in st.items() if k != "export")
                build = f"{st.get('export', 0):.2f} / {passes:.2f} / {x['session_init_s']:.2f}"
            timed, warm = x["trace"]["timed"], x["trace"]["warmup"]
            rss = [x["rss_after_warmup_mib"], *timed["rss_mib"]]
            growth = (rss[-1] - rss[0]) / max(len(rss) - 1, 1)
            faults_w = [round(f / 1000, 1) for f in warm["minor_faults"]]
            faults_t = statistics.median(timed["minor_faults"]) / 1000
            lines.append(
                f"| {name} | {'eager' if b == 'torch' else b} | {x['first_step_s']:.2f} | {build} "
                f"| {x['rss_after_warmup_mib']:.0f} | {growth:+.2f} "
                f"| {min(timed['wall_s']) * 1e3:.0f} / {max(timed['wall_s']) * 1e3:.0f} "
                f"| {x['median_cpu_step_s'] * 1e3:.0f} | {x['cpu_util']:.2f} "
                f"| {x['other_cpus']:.2f} | {faults_w}k → {faults_t:.1f}k |"
            )
    lines += [
        "",
        "CPU ms/step: median process CPU time (all threads) per step, less sensitive to other "
        "load than wall time; CPU util: CPU s per wall s in the timed steps (threads = ideal); "
        "other procs' CPUs: CPUs kept busy by other processes meanwhile (0 = quiet machine).",
        "",
    ]
    for name, r in results.items():
        for b in r:
            ms = ", ".join(f"{t * 1e3:.0f}" for t in r[b]["trace"]["warmup"]["wall_s"])
            lines.append(f"{name}: {b} warm-up step times ms: [{ms}]")
            if "eager_steps" in r[b]:
                n = r[b]["eager_steps"]
                lines.append(f"{name}: {b} steps run in eager (eager_if_faster): {n}")
    for name, r in results.items():
        for b in r:
            x = r[b]
            if contended(x):
                lines.append(
                    f"WARNING {name} {b}: other processes used {x['other_cpus']:.2f} CPUs during "
                    f"the timed steps (CPU util {x['cpu_util']:.2f} of {x['threads']} threads): "
                    "its timings are contended"
                )
        e, o = r["torch"], r["ortrain"]
        if rel_diff(e["param_checksum"], o["param_checksum"]) > 1e-9:
            lines.append(f"WARNING {name}: initial weights differ between the backends")
        d = rel_diff(e["first_loss"], o["first_loss"])
        status = "ok" if d <= LOSS_RTOL else "WARNING: first-step losses differ"
        if d > LOSS_RTOL and e["dropout"] > 0:
            status += " (expected with --dropout > 0: the backends draw different masks)"
        last_e, last_o = e["trace"]["timed"]["loss"][-1], o["trace"]["timed"]["loss"][-1]
        lines.append(
            f"{name}: first-step loss eager {e['first_loss']:.6f} ortrain {o['first_loss']:.6f} "
            f"(rel diff {d:.2e}, tol {LOSS_RTOL:g}) {status}; last loss eager {last_e:.6f} "
            f"ortrain {last_o:.6f}"
        )
    if any(r[b].get("device_peak_mib") for r in results.values() for b in r):
        lines += ["", "| workload | backend | device memory in use after the steps MiB |"]
        lines.append("|---|---|---:|")
        for name, r in results.items():
            for b in r:
                lines.append(f"| {name} | {b} | {r[b]['device_peak_mib']:.0f} |")
        first = next(iter(results.values()))
        lines.append(f"device: {next(iter(first.values()))['device']}")
    lines += [
        "",
        f"torch {torch.__version__}, onnxruntime {_ort_version()}, python "
        f"{platform.python_version()}; {cpu_description()}; total wall time {wall_s:.0f} s",
        f"code under test: commit {src['commit']}"
        + (f" + uncommitted changes in {', '.join(src['dirty'])}" if src["dirty"] else ""),
        f"command: {command}",
    ]
    return "\n".join(lines)


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--workload",
        action="append",
        choices=sorted(WORKLOADS),
        help="repeatable; default: " + ", ".join(n for n, w in WORKLOADS.items() if w.default),
    )
    p.add_argument("--backend", choices=BACKENDS, help="run one backend here (child mode)")
    p.add_argument(
        "--backends",
        default=",".join(DEFAULT_BACKENDS),
        help=f"comma-separated backends to compare, of {', '.join(BACKENDS)} (torch and "
        "ortrain are always run)",
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the first step")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--threads", type=int, default=2, help="torch / ORT intra-op threads")
    p.add_argument("--dropout", type=float, default=0.0, help="all dropout probabilities")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-batches", type=int, default=4, help="distinct batches, cycled")
    p.add_argument(
        "--repeats", type=int, default=1, help="runs per backend (keeps the fastest uncontended)"
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="before each run wait up to S seconds for the CPUs to be < 25%% busy",
    )
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--batch", type=int, help="override the workload's batch size")
    p.add_argument(
        "--find-max-batch",
        action="store_true",
        help="instead of timing: the largest batch each backend trains without running out "
        "of memory (doubling, then bisection; 3 steps per probe)",
    )
    args = p.parse_args(argv)
    chosen = [b for b in args.backends.split(",") if b]
    unknown = sorted(set(chosen) - set(BACKENDS))
    if unknown:
        p.error(f"unknown backends {unknown}; choose from {', '.join(BACKENDS)}")
    args.backends = [b for b in BACKENDS if b in {*chosen, *DEFAULT_BACKENDS}]
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def fits(args: argparse.Namespace, workload: str, backend: str, batch: int) -> bool:
    probe = argparse.Namespace(**{**vars(args), "batch": batch, "warmup": 1, "steps": 1})
    r = run_child(probe, workload, backend, check=False)
    ok = r is not None
    print(f"[{workload} {backend}] batch {batch}: {'fits' if ok else 'out of memory'}", flush=True)
    return ok


def max_batch(args: argparse.Namespace, workload: str, backend: str) -> int:
    """Largest batch that trains: double until a probe fails, then bisect."""
    lo, hi = 0, WORKLOADS[workload].batch
    while fits(args, workload, backend, hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(args, workload, backend, mid) else (lo, mid)
    return lo


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workloads = args.workload or [n for n, w in WORKLOADS.items() if w.default]
    if args.backend is not None:  # child: one backend, one workload
        if len(workloads) != 1 or not args.json:
            raise SystemExit("--backend needs exactly one --workload and --json PATH")
        args.workload = workloads[0]
        Path(args.json).write_text(json.dumps(run_backend(args), indent=1))
        return

    command = "PYTHONPATH=. python " + shlex.join(sys.argv)
    src = source_state()
    if args.find_max_batch:
        rows = [
            "| workload | " + " | ".join(args.backends) + " |",
            "|---|" + "---:|" * len(args.backends),
        ]
        for name in workloads:
            found = {b: max_batch(args, name, b) for b in args.backends}
            rows.append(
                f"| {name} (seq {WORKLOADS[name].seq}) | "
                + " | ".join(str(found[b]) for b in args.backends)
                + " |"
            )
        print("largest batch that trains on " + args.device + ":\n" + "\n".join(rows))
        print(f"command: {command}")
        return
    t0 = time.perf_counter()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for name in workloads:
        best: dict[str, dict[str, Any] | None] = dict.fromkeys(args.backends)
        for rep in range(args.repeats):
            for backend in args.backends:
                busy = wait_quiet(args.wait_quiet) if args.wait_quiet > 0 else None
                r = run_child(args, name, backend)
                r["cpu_busy_before_pct"] = busy
                print(
                    f"[{name} {backend} #{rep + 1}] median {r['median_step_s'] * 1e3:.1f} ms, "
                    f"first step {r['first_step_s']:.2f} s, peak RSS {r['peak_rss_mib']:.0f} MiB, "
                    f"other procs {r['other_cpus']:.2f} CPUs, process {r['process_s']:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
                best[backend] = better(best[backend], r)
        results[name] = {b: r for b, r in best.items() if r is not None}
    wall = time.perf_counter() - t0
    print(report(results, command, wall, src))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"command": command, "wall_s": wall, "source": src, "results": results}, indent=1
            )
        )


if __name__ == "__main__":
    main()
