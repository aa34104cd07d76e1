"""The GPU benchmark of scripts/gpu-checks.sh: ortrain vs eager vs torch.compile on BERT-base
(seq 128) and GPT-2 small (seq 512), fp32 and fp16, within a time budget.

Per (workload, backend) one child process (this script with ``--child``), so that each
run's device memory is its own: step time (median of the timed steps, each ending with
the loss read back), tokens/s, the torch allocator's peak (``max_memory_allocated``; for
ortrain: parameters, gradients, optimizer state and batch, which are torch tensors bound
to ONNX Runtime), the device memory in use beyond torch's reserved pool (ONNX Runtime's
arena and workspaces: activations), and the device memory in use in all. Then the largest
batch of eager and ortrain fp32: the batch doubled from the workload's until a run fails
for memory.

Every child gets the smaller of ``--run-cap-s`` and what is left of ``--budget-s``; a run
cut by its limit, or not started because the budget was spent, is reported as such.
Results: ``bench.json`` (everything) and ``bench.md`` (tables, and the issue's targets:
ortrain fp32 >= 1.15x eager, ortrain fp16 >= 1.15x torch AMP, largest batch >= 1.5x
eager's) in ``--out``.

Models run with dropout 0 in every backend (CUDA graphs refuse random draws: a replay
would repeat the captured masks), so all backends do the same work.

``--dry-run``: the same path on CPU with two tiny models, a short budget and
``torch.compile(backend="eager")`` (no inductor build), so that the script can be
rehearsed without a GPU (tests/test_gpu_path.py runs it through scripts/gpu-checks.sh);
there ``ortrain-cudagraph`` runs without capture (CUDA graphs need CUDA).

    PYTHONPATH=. python benchmarks/bench_gpu.py --out gpu-out/bench --budget-s 240
    PYTHONPATH=. python benchmarks/bench_gpu.py --dry-run --out /tmp/bench
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import (  # benchmarks/ is not a package: found by the path above
    WORKLOADS,
    Workload,
    _bert_mlm,
    _gpt2,
    _lm_batch,
    _mlm_batch,
    _quiet_transformers,
    device_used_bytes,
    peak_rss_bytes,
    setup_ortrain,
    setup_torch,
)

BACKENDS = (
    "torch",
    "torch-compile",
    "ortrain",
    "ortrain-cudagraph",
    "torch-amp-fp16",
    "ortrain-fp16",
)
LARGEST_BACKENDS = ("torch", "ortrain")
GPU_WORKLOADS = ("bert-base", "gpt2-small-512")
DRY_WORKLOADS = {
    w.name: w
    for w in (
        Workload("gpt2-dry", 2, 32, 256, _gpt2(1, 32, 2, 64), _lm_batch, default=False),
        Workload("bert-dry", 2, 32, 256, _bert_mlm(1, 32, 2, 64), _mlm_batch, default=False),
    )
}
# The targets: speedup at equal batch, and the largest batch against eager's.
TARGETS = {
    "ortrain fp32 vs eager": ("ortrain", "torch", 1.15),
    "ortrain fp16 vs torch AMP fp16": ("ortrain-fp16", "torch-amp-fp16", 1.15),
}
LARGEST_TARGET = 1.5
_OOM = (
    "out of memory",
    "outofmemory",
    "failed to allocate",
    "cuda_error_out_of_memory",
    "cudaerrormemoryallocation",
    "bfcarena",
)
MIB = 2**20


def workload(name: str) -> Workload:
    return DRY_WORKLOADS.get(name) or WORKLOADS[name]


# --------------------------------------------------------------------------- one run
def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """One backend on one workload at one batch size, in this process."""
    w = dataclasses.replace(workload(args.workload), batch=args.batch)
    device, backend = args.device, args.backend
    torch.set_num_threads(args.threads)
    _quiet_transformers()
    if device == "cuda":
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats()
    base_used = device_used_bytes(device)
    torch.manual_seed(0)
    model = w.build(w, 0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    batches = [w.make_batch(w, g) for _ in range(4)]
    if backend.startswith("torch"):
        model.to(device)
        amp = backend.removeprefix("torch-amp-") if "amp" in backend else None
        if backend == "torch-compile":
            model = torch.compile(model, backend="eager" if args.dry_run else "inductor")
        s = setup_torch(model, opt, device, amp)
    else:
        precision = "fp16" if backend == "ortrain-fp16" else None
        graph = backend == "ortrain-cudagraph" and device == "cuda"
        s = setup_ortrain(model, opt, args.threads, precision, device, graph)
    times, losses = [], []
    for i in range(1 + args.warmup + args.steps):
        t0 = time.perf_counter()
        losses.append(s.step(batches[i % len(batches)]))
        times.append(time.perf_counter() - t0)
        if i == 0:
            s.after_first()
    timed = times[1 + args.warmup :]
    median = statistics.median(timed)
    used = device_used_bytes(device) - base_used
    out = {
        "ok": True,
        "first_step_s": times[0],
        "median_step_s": median,
        "tokens_per_s": w.batch * w.seq / median,
        "losses": losses,
        "device_used_mib": used / MIB,
    }
    if device == "cuda":
        reserved = torch.cuda.max_memory_reserved()
        out["torch_peak_mib"] = torch.cuda.max_memory_allocated() / MIB
        out["torch_reserved_mib"] = reserved / MIB
        out["beyond_torch_mib"] = max(used - reserved, 0) / MIB
    else:
        out["peak_rss_mib"] = peak_rss_bytes() / MIB
    return out


def child_main(args: argparse.Namespace) -> None:
    try:
        result = run_one(args)
    except Exception as exc:  # reported, not raised: an OOM is a result here
        text = f"{type(exc).__name__}: {exc}"
        result = {"ok": False, "oom": any(k in text.lower() for k in _OOM), "error": text[:2000]}
    Path(args.json).write_text(json.dumps(result))


# --------------------------------------------------------------------------- the plan
@dataclasses.dataclass
class Budget:
    total_s: float
    run_cap_s: float
    start: float = dataclasses.field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.total_s - (time.monotonic() - self.start)


def run_child(
    args: argparse.Namespace, budget: Budget, name: str, backend: str, batch: int
) -> dict[str, Any]:
    w = workload(name)
    head = {"workload": name, "backend": backend, "batch": batch, "seq": w.seq}
    limit = min(budget.run_cap_s, budget.left())
    if limit < 5:
        return {**head, "ok": False, "skipped": "the benchmark's time budget was spent"}
    out = Path(args.out) / "runs" / f"{name}.{backend}.{batch}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--workload",
        name,
        "--backend",
        backend,
        "--batch",
        str(batch),
        "--device",
        args.device,
        "--threads",
        str(args.threads),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--json",
        str(out),
    ] + (["--dry-run"] if args.dry_run else [])
    t0 = time.monotonic()
    log = out.with_suffix(".log")
    try:
        with open(log, "w") as f:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=limit)
    except subprocess.TimeoutExpired:
        return {**head, "ok": False, "cut": f"cut at its limit of {limit:.0f} s"}
    wall = time.monotonic() - t0
    if not out.is_file():
        tail = log.read_text()[-1500:]
        return {**head, "ok": False, "error": f"exit {proc.returncode}: {tail}", "wall_s": wall}
    result = json.loads(out.read_text())
    print(f"[{name} {backend} batch {batch}] {_brief(result)} ({wall:.0f} s)", flush=True)
    return {**head, **result, "wall_s": wall}


def _brief(r: dict[str, Any]) -> str:
    if r.get("ok"):
        return f"{1000 * r['median_step_s']:.1f} ms/step, {r['tokens_per_s']:.0f} tok/s"
    if r.get("oom"):
        return "out of memory"
    return r.get("cut") or r.get("skipped") or (r.get("error") or "failed")[:200]


def largest_batch(
    args: argparse.Namespace, budget: Budget, name: str, backend: str, first: dict | None
) -> dict[str, Any]:
    """Double the batch from the workload's until a run fails for memory (or the budget
    ends, or ``--max-doublings``): the largest that ran, and why the search stopped."""
    batch = workload(name).batch
    runs = [first] if first is not None and first.get("ok") else []
    if not runs:
        runs.append(run_child(args, budget, name, backend, batch))
    for _ in range(args.max_doublings):
        if not runs[-1].get("ok"):
            break
        batch *= 2
        runs.append(run_child(args, budget, name, backend, batch))
    fitted = [r["batch"] for r in runs if r.get("ok")]
    last = runs[-1]
    if last.get("ok"):
        stop = f"not searched past {args.max_doublings} doublings"
    elif last.get("oom"):
        stop = f"out of memory at batch {last['batch']}"
    else:
        stop = f"batch {last['batch']}: {_brief(last)}"
    return {
        "workload": name,
        "backend": backend,
        "largest_batch": max(fitted) if fitted else 0,
        "exact": bool(last.get("oom")),  # True: the next doubling ran out of memory
        "stopped": stop,
        "runs": runs,
    }


# --------------------------------------------------------------------------- reporting
def summarize(runs: list[dict], largest: list[dict]) -> dict[str, Any]:
    """Speedups against the baselines and the issue's targets (None where a run is missing)."""
    by = {(r["workload"], r["backend"]): r for r in runs if r.get("ok")}
    checks = []
    for wl in dict.fromkeys(r["workload"] for r in runs):
        for what, (a, b, target) in TARGETS.items():
            ra, rb = by.get((wl, a)), by.get((wl, b))
            ratio = rb["median_step_s"] / ra["median_step_s"] if ra and rb else None
            checks.append(_check(wl, what, ratio, target))
        sizes = {x["backend"]: x for x in largest if x["workload"] == wl}
        ort, eager = sizes.get("ortrain"), sizes.get("torch")
        ratio = None
        if ort and eager and eager["largest_batch"]:
            ratio = ort["largest_batch"] / eager["largest_batch"]
        check = _check(wl, "largest batch ortrain fp32 vs eager", ratio, LARGEST_TARGET)
        if ratio is not None and not (ort["exact"] and eager["exact"]):
            check["note"] = "a search stopped before running out of memory: a lower bound"
        checks.append(check)
    return {"checks": checks}


def _check(wl: str, what: str, ratio: float | None, target: float) -> dict[str, Any]:
    met = None if ratio is None else ratio >= target
    return {"workload": wl, "what": what, "ratio": ratio, "target": target, "met": met}


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [
        f"# GPU benchmark{' (dry run on CPU: tiny models)' if meta['dry_run'] else ''}",
        "",
        f"{meta['device_name']}; torch {meta['torch']}, onnxruntime {meta['onnxruntime']}; "
        f"{meta['steps']} timed steps after {meta['warmup']} warm-up; dropout 0; "
        f"budget {meta['budget_s']:.0f} s, used {meta['used_s']:.0f} s.",
        "",
        "| workload | backend | batch | ms/step | tokens/s | vs eager | torch peak MiB "
        "| beyond torch MiB | device MiB | first step s | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    eager = {r["workload"]: r for r in result["runs"] if r["backend"] == "torch" and r.get("ok")}
    for r in result["runs"]:
        if not r.get("ok"):
            note = _brief(r).replace("|", "/").replace("\n", " ")[:160]
            head = f"| {r['workload']} | {r['backend']} | {r['batch']} |"
            lines.append(f"{head}{' |' * 7} {note} |")  # the 7 figures left empty
            continue
        e = eager.get(r["workload"])
        vs = f"{e['median_step_s'] / r['median_step_s']:.2f}x" if e else ""
        lines.append(
            f"| {r['workload']} | {r['backend']} | {r['batch']} | {1000 * r['median_step_s']:.1f} "
            f"| {r['tokens_per_s']:.0f} | {vs} | {_mib(r, 'torch_peak_mib')} "
            f"| {_mib(r, 'beyond_torch_mib')} | {_mib(r, 'device_used_mib')} "
            f"| {r['first_step_s']:.1f} | |"
        )
    lines += ["", "| workload | backend | largest batch | search stopped |", "|---|---|---:|---|"]
    for x in result["largest"]:
        lines.append(
            f"| {x['workload']} | {x['backend']} | {x['largest_batch']} | {x['stopped']} |"
        )
    lines += ["", "| workload | target | ratio | needed | met |", "|---|---|---:|---:|---|"]
    for c in result["summary"]["checks"]:
        ratio = "" if c["ratio"] is None else f"{c['ratio']:.2f}x"
        met = {None: "n/a", True: "yes", False: "no"}[c["met"]]
        note = f" ({c['note']})" if c.get("note") else ""
        lines.append(f"| {c['workload']} | {c['what']} | {ratio} | {c['target']}x | {met}{note} |")
    return "\n".join(lines) + "\n"


def _mib(r: dict[str, Any], key: str) -> str:
    return f"{r[key]:.0f}" if key in r else ""


def _versions(device: str) -> dict[str, str]:
    import onnxruntime as ort

    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    return {"device_name": name, "torch": torch.__version__, "onnxruntime": ort.__version__}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args)
        return 0
    budget = Budget(args.budget_s, args.run_cap_s)
    names = list(DRY_WORKLOADS) if args.dry_run else list(GPU_WORKLOADS)
    if args.workloads:
        unknown = sorted(set(args.workloads) - set(names))
        if unknown:
            raise SystemExit(f"unknown workload(s) {unknown}: {', '.join(names)}")
        names = [n for n in names if n in args.workloads]
    # In order of what the issue asks most, so that a short budget drops the least:
    # fp32 against eager, fp16 against AMP, the largest batch, then torch.compile and
    # CUDA graphs.
    chosen = [b for b in BACKENDS if b in args.backends]
    first = [b for b in chosen if b in ("torch", "ortrain", "torch-amp-fp16", "ortrain-fp16")]
    done: dict[tuple[str, str], dict[str, Any]] = {}
    for backend in first:
        for name in names:
            done[name, backend] = run_child(args, budget, name, backend, workload(name).batch)
    largest = [
        largest_batch(args, budget, name, backend, done.get((name, backend)))
        for name in names
        for backend in LARGEST_BACKENDS
        if backend in chosen
    ]
    for backend in (b for b in chosen if b not in first):
        for name in names:
            done[name, backend] = run_child(args, budget, name, backend, workload(name).batch)
    runs = [done[name, backend] for name in names for backend in chosen]
    result = {
        "meta": {
            **_versions(args.device),
            "dry_run": args.dry_run,
            "steps": args.steps,
            "warmup": args.warmup,
            "budget_s": args.budget_s,
            "used_s": time.monotonic() - budget.start,
        },
        "runs": runs,
        "largest": largest,
        "summary": summarize(runs, largest),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    (out / "bench.md").write_text(markdown(result))
    print((out / "bench.md").read_text())
    return 0 if all(r.get("ok") for r in runs) else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny models (a rehearsal)")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-out") + "/bench")
    p.add_argument("--budget-s", type=float, help="the whole benchmark (default 300; dry 150)")
    p.add_argument("--run-cap-s", type=float, help="one child run (default 150; dry 60)")
    p.add_argument("--steps", type=int, help="timed steps (default 10; dry 2)")
    p.add_argument("--warmup", type=int, help="untimed steps after the first (default 3; dry 1)")
    p.add_argument("--max-doublings", type=int, help="largest-batch search (default 6; dry 1)")
    p.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    p.add_argument("--backends", type=lambda s: s.split(","), default=list(BACKENDS))
    p.add_argument(
        "--workloads", type=lambda s: s.split(","), help="a subset of the workloads (default all)"
    )
    # child only
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--device", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    dry = args.dry_run
    defaults = {
        "budget_s": 150 if dry else 300,
        "run_cap_s": 60 if dry else 150,
        "steps": 2 if dry else 10,
        "warmup": 1 if dry else 3,
        "max_doublings": 1 if dry else 6,
    }
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.device is None:
        args.device = "cpu" if dry else "cuda"
    unknown = set(args.backends) - set(BACKENDS)
    if unknown:
        p.error(f"unknown backends {sorted(unknown)}; known: {', '.join(BACKENDS)}")
    return args


if __name__ == "__main__":
    sys.exit(main())
