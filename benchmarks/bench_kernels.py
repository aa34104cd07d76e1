"""Fused optimizer kernels (cuda_kernels/) vs torch.optim.AdamW, side by side.

One AdamW step over N parameters split into T tensors (views of one flat buffer):

  fused kernel       ``ortrain.runtime.kernels.adamw_`` over the flat buffer, one call,
                     unscaling the gradients in-kernel (grad_scale) and, with
                     ``--half-copy``, writing the bf16 parameter copy as well;
  torch single       ``torch.optim.AdamW(foreach=False)``: one chain of ops per tensor;
  torch foreach      ``foreach=True``: multi-tensor ops;
  torch fused        ``fused=True``: torch's fused kernel.

The torch rows do no unscale (their gradients are already scaled): they do less work than
the fused row. Then the gradient check: ``all_finite_sq_norm`` vs torch's norm plus an
isfinite test. Each row reports the median over ``--steps`` timed steps (after
``--warmup``) and the effective bandwidth of the bytes the update must move.

On a CUDA device everything runs there (CUDA events). Without one, the CPU reference
library runs against torch on the CPU, and the report says so: the reference is a plain
single-threaded loop, written to be checked against, not to be fast.

Usage::

    cmake -S . -B build && cmake --build build -j      # the libraries
    PYTHONPATH=. python benchmarks/bench_kernels.py
    PYTHONPATH=. python benchmarks/bench_kernels.py --numel 200000000 --tensors 400 --half-copy
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from ortrain.runtime import kernels

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


@dataclasses.dataclass(frozen=True)
class Config:
    numel: int
    tensors: int
    steps: int
    warmup: int
    device: str
    grad_dtype: torch.dtype
    half_copy: bool


def timed(fn: Callable[[], object], cfg: Config) -> float:
    """Median seconds of one call of ``fn``."""
    cuda = cfg.device == "cuda"
    for _ in range(cfg.warmup):
        fn()
    times = []
    for _ in range(cfg.steps):
        if cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def split_sizes(numel: int, tensors: int) -> list[int]:
    base, extra = divmod(numel, tensors)
    return [base + (i < extra) for i in range(tensors)]


def bench_adamw(cfg: Config) -> list[tuple[str, float, int]]:
    dev, n = cfg.device, cfg.numel
    g = torch.Generator(device=dev).manual_seed(0)
    flat_p = torch.randn(n, device=dev, generator=g)
    flat_g = torch.randn(n, device=dev, generator=g).to(cfg.grad_dtype)
    m, v = torch.zeros_like(flat_p), torch.zeros_like(flat_p)
    half = torch.empty(n, dtype=torch.bfloat16, device=dev) if cfg.half_copy else None
    step = [0]

    def fused() -> None:
        step[0] += 1
        kernels.adamw_(
            flat_p, flat_g, m, v, **HP, step=step[0], grad_scale=0.5, half_param=half
        )  # fmt: skip

    grad_bytes = flat_g.element_size()
    moved = n * (6 * 4 + grad_bytes + (2 if half is not None else 0))  # p, m, v r/w + g (+ half)
    rows = [("fused kernel (adamw_)", timed(fused, cfg), moved)]

    sizes = split_sizes(n, cfg.tensors)
    for name, kw in [
        ("torch.optim.AdamW single", {"foreach": False}),
        ("torch.optim.AdamW foreach", {"foreach": True}),
        ("torch.optim.AdamW fused", {"fused": True}),
    ]:
        params = [t.requires_grad_() for t in torch.randn(n, device=dev).split(sizes)]
        for p, grad in zip(params, flat_g.float().split(sizes)):
            p.grad = grad
        try:
            opt = torch.optim.AdamW(params, lr=HP["lr"], weight_decay=HP["weight_decay"], **kw)
            rows.append((name, timed(opt.step, cfg), n * 7 * 4))
        except (RuntimeError, ValueError) as e:  # e.g. fused unsupported on this device
            print(f"skipped {name}: {e}")
    return rows


def bench_norm(cfg: Config) -> list[tuple[str, float, int]]:
    dev, n = cfg.device, cfg.numel
    x = torch.randn(n, device=dev).to(cfg.grad_dtype)
    sq, found = torch.empty((), device=dev), torch.empty((), device=dev)

    def ours() -> None:
        kernels.all_finite_sq_norm(x, sq_norm=sq, found_inf=found)

    def torch_norm() -> None:
        norm = torch.linalg.vector_norm(x, dtype=torch.float32)
        torch.logical_not(torch.isfinite(norm))

    moved = n * x.element_size()
    return [
        ("fused all_finite_sq_norm", timed(ours, cfg), moved),
        ("torch vector_norm + isfinite", timed(torch_norm, cfg), moved),
    ]


def report(title: str, rows: list[tuple[str, float, int]]) -> str:
    base = rows[0][1]
    lines = [f"\n### {title}\n", "| variant | ms | GB/s | vs fused |", "|---|---:|---:|---:|"]
    for name, sec, moved in rows:
        lines.append(f"| {name} | {sec * 1e3:.3f} | {moved / sec / 1e9:.1f} | {sec / base:.2f}x |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> Config:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=50_000_000 if cuda else 2_000_000)
    p.add_argument("--tensors", type=int, default=200, help="tensors for the torch rows")
    p.add_argument("--steps", type=int, default=20 if cuda else 5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--grad-dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    p.add_argument("--half-copy", action="store_true", help="also write a bf16 parameter copy")
    a = p.parse_args(argv)
    return Config(
        a.numel, a.tensors, a.steps, a.warmup, "cuda" if cuda else "cpu",
        getattr(torch, a.grad_dtype), a.half_copy,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    if cfg.device == "cuda":
        where = f"CUDA: {torch.cuda.get_device_name()}"
    else:
        where = (
            "no CUDA device: timing the single-threaded CPU reference library against torch "
            f"on the CPU ({torch.get_num_threads()} threads); not a measure of the CUDA kernels"
        )
    print(f"{where}\n{cfg}")
    print(report(f"AdamW step, {cfg.numel:,} parameters", bench_adamw(cfg)))
    print(report(f"all-finite + squared norm, {cfg.numel:,} elements", bench_norm(cfg)))


if __name__ == "__main__":
    main()
