"""Time to first step: ortrain cold and warm (its on-disk graph cache), ONNX Runtime's
training engine, torch.compile and eager PyTorch, on the same workloads, in one run.

Each measurement runs in a fresh process (this script re-invoked with ``--child MODE``):
build the model (seeded) and AdamW, then time from the trainer's construction (or the
export, or ``torch.compile``) to the end of the first step, the loss read back. Modes:

  eager         PyTorch: forward, backward, AdamW step;
  ortrain-cold  ORTTrainer with an empty graph cache (``ORTRAIN_GRAPH_CACHE`` at a new
                folder): export / passes from ``trainer.build_log``, session from the
                graph cache's ``session_log``, the rest (update setup, first run) as
                "other";
  ortrain-warm  the same, a second process on that folder: the graphs load from disk;
  compile       ``torch.compile(model)`` (inductor): first forward, backward, AdamW step;
  ort-training  ONNX Runtime's training engine: ``torch.onnx.export`` (TorchScript,
                opset 14), ``onnxruntime.training.artifacts.generate_artifacts`` (its
                CrossEntropyLoss block, ignore_index -100, and AdamW), the sessions
                (``CheckpointState``, ``Module``, ``Optimizer``), the first step. Needs a
                Python with ``onnxruntime-training`` (``--ort-training-python``); it ships
                for onnxruntime 1.19 at the latest, which reads ONNX IR <= 10, so that
                environment needs ``onnx<1.18`` too (usage below).

Usage::

    PYTHONPATH=. python benchmarks/bench_first_step.py            # the three workloads
    PYTHONPATH=. python benchmarks/bench_first_step.py --workloads gpt2-tiny \\
        --modes eager,ortrain-cold,ortrain-warm
    # ONNX Runtime's engine in its own environment (it replaces onnxruntime there):
    python -m venv --system-site-packages /tmp/ortt && \\
        /tmp/ortt/bin/pip install onnxruntime-training==1.19.2 onnx==1.17.0
    PYTHONPATH=. python benchmarks/bench_first_step.py --ort-training-python /tmp/ortt/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_train import WORKLOADS, Workload, _quiet_transformers  # noqa: E402

MODES = ("eager", "ortrain-cold", "ortrain-warm", "compile", "ort-training")
DEFAULT_WORKLOADS = ("gpt2-tiny", "bert-tiny", "gpt2-small")


def _setup(w: Workload) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    _quiet_transformers()
    torch.manual_seed(0)
    model = w.build(w, 0.0)
    batch = w.make_batch(w, torch.Generator().manual_seed(1))
    return model, batch


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)


def run_eager(w: Workload, compiled: bool) -> dict[str, Any]:
    model, batch = _setup(w)
    opt = _adamw(model)
    t = time.perf_counter()
    run = torch.compile(model) if compiled else model
    loss = run(**batch).loss
    loss.backward()
    opt.step()
    value = loss.item()
    total = time.perf_counter() - t
    opt.zero_grad()
    t = time.perf_counter()  # a later step, for scale: the first pays lazy imports and warm-up
    run(**batch).loss.backward()
    opt.step()
    return {"total": total, "loss": value, "next_step": time.perf_counter() - t}


def run_ortrain(w: Workload) -> dict[str, Any]:
    from ortrain import ORTTrainer, TrainerOptions

    model, batch = _setup(w)
    opt = _adamw(model)
    t = time.perf_counter()
    trainer = ORTTrainer(model, opt, TrainerOptions())
    loss = trainer.train_step(**batch).item()
    total = time.perf_counter() - t
    stages: dict[str, float] = {"export": 0.0, "passes": 0.0, "session": 0.0, "cache": 0.0}
    for r in trainer.build_log + trainer._ctx.graph_cache.session_log:
        key = r.stage if r.stage in stages else "passes"
        stages[key] += r.seconds
    return {"total": total, "loss": loss, "cache_hits": trainer.cache_hits, **stages}


class _LogitsOnly(torch.nn.Module):
    """The model's next-token (GPT-2) or token (BERT) logits as [N, vocab]: ONNX Runtime's
    loss block adds the cross-entropy (a model-computed loss does not differentiate there:
    its SoftmaxCrossEntropyLoss has no log-prob output)."""

    def __init__(self, model: torch.nn.Module, names: list[str], shift: bool) -> None:
        super().__init__()
        self.model, self.names, self.shift = model, names, shift

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        logits = self.model(**dict(zip(self.names, inputs, strict=True))).logits
        if self.shift:
            logits = logits[:, :-1]
        return logits.reshape(-1, logits.shape[-1])


def run_ort_training(w: Workload, workdir: Path) -> dict[str, Any]:
    import onnx
    from onnxruntime.training import api, artifacts, onnxblock

    model, batch = _setup(w)
    labels = batch["labels"]
    shift = "gpt2" in w.name
    names = [k for k in batch if k != "labels"]
    targets = (labels[:, 1:] if shift else labels).reshape(-1)
    wrapper = _LogitsOnly(model, names, shift)
    inputs = tuple(batch[k] for k in names)
    out = {}
    t = time.perf_counter()
    path = workdir / "forward.onnx"
    torch.onnx.export(
        wrapper,
        inputs,
        str(path),
        input_names=names,
        output_names=["logits"],
        dynamo=False,
        opset_version=14,
        do_constant_folding=False,
        training=torch.onnx.TrainingMode.TRAINING,
    )
    forward = onnx.load(str(path))
    out["export"] = time.perf_counter() - t
    t2 = time.perf_counter()
    params = {n for n, _ in wrapper.named_parameters()}
    floats = [i.name for i in forward.graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
    art = workdir / "artifacts"
    art.mkdir()
    artifacts.generate_artifacts(
        forward,
        requires_grad=[n for n in floats if n in params],
        frozen_params=[n for n in floats if n not in params],
        loss=onnxblock.loss.CrossEntropyLoss(ignore_index=-100),
        optimizer=artifacts.OptimType.AdamW,
        artifact_directory=str(art),
    )
    out["passes"] = time.perf_counter() - t2
    t2 = time.perf_counter()
    state = api.CheckpointState.load_checkpoint(str(art / "checkpoint"))
    module = api.Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"))
    optimizer = api.Optimizer(str(art / "optimizer_model.onnx"), module)
    out["session"] = time.perf_counter() - t2
    module.train()
    loss = module(*[x.numpy() for x in inputs], targets.numpy())
    optimizer.step()
    module.lazy_reset_grad()
    out["total"] = time.perf_counter() - t
    out["loss"] = float(loss)
    return out


def child(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    w = WORKLOADS[args.workload]
    if args.child == "eager":
        result = run_eager(w, compiled=False)
    elif args.child == "compile":
        result = run_eager(w, compiled=True)
    elif args.child == "ort-training":
        with tempfile.TemporaryDirectory() as d:
            result = run_ort_training(w, Path(d))
    else:
        result = run_ortrain(w)
    print("RESULT " + json.dumps(result))


def measure(args: argparse.Namespace, workload: str, mode: str, cache: Path) -> dict[str, Any]:
    python = args.ort_training_python if mode == "ort-training" else sys.executable
    if python is None:
        return {"error": "not run: no --ort-training-python (a Python with onnxruntime-training)"}
    cmd = [python, __file__, "--child", mode, "--workload", workload]
    cmd += ["--threads", str(args.threads)]
    env = dict(os.environ, ORTRAIN_GRAPH_CACHE=str(cache))
    root = str(HERE.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = [ln for ln in done.stderr.strip().splitlines() if ln.strip()][-1:] or ["no output"]
    return {"error": f"failed: {tail[0][:160]}"}


def _s(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}"


def table(results: list[tuple[str, str, dict[str, Any]]]) -> str:
    rows = [
        "| workload | mode | first step (s) | export | passes / artifacts | session | "
        "cache load | other | first loss | next step |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for workload, mode, r in results:
        if "error" in r:
            rows.append(f"| {workload} | {mode} | {r['error']} |  |  |  |  |  |  |  |")
            continue
        if mode == "ortrain-warm" and r.get("cache_hits") == 0:  # say so, never hide it
            mode += " (missed: the key changed between the runs)"
        parts = [r.get(k) for k in ("export", "passes", "session", "cache")]
        known = sum(p for p in parts if p is not None)
        other = r["total"] - known if any(p is not None for p in parts) else None
        rows.append(
            f"| {workload} | {mode} | {r['total']:.2f} | "
            + " | ".join(_s(p) for p in parts)
            + f" | {_s(other)} | {r['loss']:.4f} | {_s(r.get('next_step'))} |"
        )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--ort-training-python", default=None)
    p.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 8))
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", type=Path, default=None, help="also write the table here")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    results = []
    for workload in args.workloads.split(","):
        with tempfile.TemporaryDirectory(prefix="ortrain-graphs-") as cache:
            for mode in args.modes.split(","):
                r = measure(args, workload, mode, Path(cache))
                results.append((workload, mode, r))
                print(f"{workload:<11} {mode:<13} {r}", file=sys.stderr, flush=True)
    text = table(results)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
