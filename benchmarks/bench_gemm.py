"""GEMM throughput on this CPU: ONNX Runtime's kernels (MLAS) vs torch's (MKL / oneDNN).

ortrain's step on GPT-2 and BERT is 75-90% GEMM, so how fast ONNX Runtime multiplies
matrices next to torch on the CPU at hand bounds every speedup that ``bench_train.py``
can show. This runs the products of the benchmark workloads' training steps the way
ortrain's graphs spell them (``Gemm`` with its trans flags, ``FusedMatMul`` for the LM
head's logits) and the same products in torch (``a @ b`` on transposed views), each in
turn in every round (so drift hits both alike), on ``--threads`` threads each.
``--sequential`` runs all of one backend's rounds before the other's instead: torch's
OpenMP threads keep spinning for a while after each product and slow an ONNX Runtime run
that follows at once, so the alternating figures are a little low for ONNX Runtime.

Usage::

    PYTHONPATH=. python benchmarks/bench_gemm.py
    PYTHONPATH=. python benchmarks/bench_gemm.py --workloads gpt2-small --rounds 9
    PYTHONPATH=. python benchmarks/bench_gemm.py --sequential
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hardware import cpu_description


@dataclasses.dataclass(frozen=True)
class Product:
    """Y[m, n] = op(A) op(B), A stored [k, m] when trans_a, B stored [n, k] when trans_b."""

    what: str
    m: int
    k: int
    n: int
    trans_a: int = 0
    trans_b: int = 0
    op: str = "Gemm"

    @property
    def gflop(self) -> float:
        return 2.0 * self.m * self.k * self.n / 1e9

    def shapes(self) -> tuple[list[int], list[int]]:
        a = [self.k, self.m] if self.trans_a else [self.m, self.k]
        b = [self.n, self.k] if self.trans_b else [self.k, self.n]
        return a, b


def products(tokens: int, hidden: int, vocab: int) -> list[Product]:
    """A transformer block's and the LM head's products, forward and backward."""
    h, f = hidden, 4 * hidden
    return [
        Product("qkv forward", tokens, h, 3 * h),
        Product("mlp up forward", tokens, h, f),
        Product("mlp down forward", tokens, f, h),
        Product("mlp up dX", tokens, f, h, trans_b=1),
        Product("mlp up dW", h, tokens, f, trans_a=1),
        Product("mlp down dW", f, tokens, h, trans_a=1),
        Product("LM head logits", tokens, h, vocab, trans_b=1, op="FusedMatMul"),
        Product("LM head dX", tokens, vocab, h),
        Product("LM head dW", vocab, tokens, h, trans_a=1),
    ]


WORKLOADS = {
    "gpt2-tiny": (1024, 256, 8192),  # bench_train.py: batch 8 x seq 128
    "gpt2-small": (512, 768, 50257),  # batch 2 x seq 256
}


def ort_runner(p: Product, a: np.ndarray, b: np.ndarray, threads: int) -> Callable[[], None]:
    sa, sb = p.shapes()
    domain = "com.microsoft" if p.op == "FusedMatMul" else ""
    node = helper.make_node(
        p.op, ["A", "B"], ["Y"], domain=domain, transA=p.trans_a, transB=p.trans_b
    )
    graph = helper.make_graph(
        [node],
        "product",
        [
            helper.make_tensor_value_info("A", TensorProto.FLOAT, sa),
            helper.make_tensor_value_info("B", TensorProto.FLOAT, sb),
        ],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [p.m, p.n])],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as ortrain's
    sess = ort.InferenceSession(
        helper.make_model(graph, opset_imports=opsets).SerializeToString(),
        so,
        providers=["CPUExecutionProvider"],
    )
    binding = sess.io_binding()
    binding.bind_cpu_input("A", a)
    binding.bind_cpu_input("B", b)
    out = np.empty((p.m, p.n), np.float32)
    binding.bind_output("Y", "cpu", 0, np.float32, [p.m, p.n], out.ctypes.data)

    def run(bound: tuple = (a, b, out)) -> None:  # bound by pointer: keep them alive
        sess.run_with_iobinding(binding)

    return run


def torch_runner(p: Product, a: np.ndarray, b: np.ndarray) -> Callable[[], None]:
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    ta, tb = (ta.T if p.trans_a else ta), (tb.T if p.trans_b else tb)
    out = torch.empty(p.m, p.n)
    return lambda: torch.matmul(ta, tb, out=out)


def measure(p: Product, rounds: int, threads: int, sequential: bool) -> tuple[float, float]:
    """Median GFLOP/s of (ONNX Runtime, torch) over ``rounds`` runs each, alternating
    (or one backend's runs back to back, then the other's)."""
    rng = np.random.default_rng(0)
    sa, sb = p.shapes()
    a = rng.standard_normal(sa, dtype=np.float32)
    b = rng.standard_normal(sb, dtype=np.float32)
    runners = [ort_runner(p, a, b, threads), torch_runner(p, a, b)]
    times: list[list[float]] = [[], []]
    order = [(r, i) for r in range(rounds + 1) for i in range(2)]
    if sequential:
        order.sort(key=lambda ri: ri[1])
    for r, i in order:
        t = time.perf_counter()
        runners[i]()
        if r:  # the first round warms up
            times[i].append(time.perf_counter() - t)
    ort_s, torch_s = (statistics.median(t) for t in times)
    return p.gflop / ort_s, p.gflop / torch_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sequential", action="store_true", help="each backend's runs in a row")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [("reference", Product("2048^3", 2048, 2048, 2048))]
    for name in args.workloads.split(","):
        rows += [(name, p) for p in products(*WORKLOADS[name])]
    lines = [
        "| workload | product | m x k x n | flags | ONNX Runtime GFLOP/s | torch GFLOP/s "
        "| torch / ONNX Runtime |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for name, p in rows:
        ort_rate, torch_rate = measure(p, args.rounds, args.threads, args.sequential)
        flags = f"{p.op}" + (" transA" if p.trans_a else "") + (" transB" if p.trans_b else "")
        lines.append(
            f"| {name} | {p.what} | {p.m} x {p.k} x {p.n} | {flags} | {ort_rate:.0f} | "
            f"{torch_rate:.0f} | {torch_rate / ort_rate:.2f} |"
        )
        print(lines[-1], flush=True)
    print()
    print("\n".join(lines))
    print(
        f"\nonnxruntime {ort.__version__}, torch {torch.__version__}; {cpu_description()}; "
        f"{args.threads} threads, median of {args.rounds} "
        + ("runs in a row per backend" if args.sequential else "alternating runs")
    )
    print("command: PYTHONPATH=. python benchmarks/bench_gemm.py " + shlex.join(sys.argv[1:]))


if __name__ == "__main__":
    main()
