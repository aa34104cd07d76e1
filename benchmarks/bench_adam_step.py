"""``ortrain.cpu.AdamStep`` with its gradient in the parameter's layout vs transposed
(``grad_transposed``, graph_passes/targets/cpu/transposed_weight_grad.py), side by side in one run.

Each row: one AdamW step over a [rows, cols] parameter (default GPT-2 small's tied table,
[50257, 768]) in its own ONNX Runtime session, the buffers bound in place, the median
and best of ``--steps`` calls after ``--warmup``; ``--threads`` intra-op threads.

Usage::

    PYTHONPATH=. python benchmarks/bench_adam_step.py
    PYTHONPATH=. python benchmarks/bench_adam_step.py --rows 30522 --cols 768 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from ortrain.core.names import CPU_DOMAIN, HYPER_NAMES
from ortrain.runtime import cpu_ops

NAMES = ["P", "G", "M", "V", "H", "L"]


def _session(arrays: dict[str, np.ndarray], transposed: bool, threads: int):
    f32 = TensorProto.FLOAT
    vis = [helper.make_tensor_value_info(n, f32, list(arrays[n].shape)) for n in NAMES]
    attrs = {"grad_transposed": 1} if transposed else {}
    # omp_team = 0: on ONNX Runtime's threads, as in graphs whose products are MLAS's
    node = helper.make_node("AdamStep", NAMES, ["done"], domain=CPU_DOMAIN, omp_team=0, **attrs)
    out = [helper.make_tensor_value_info("done", f32, [])]
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(CPU_DOMAIN, 1)]
    proto = helper.make_model(helper.make_graph([node], "adam", vis, out), opset_imports=opsets)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.register_custom_ops_library(str(cpu_ops.library_path()))
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    binding = sess.io_binding()
    for name in NAMES:
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arrays[name]))
    binding.bind_output("done")
    return sess, binding


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=50257)
    p.add_argument("--cols", type=int, default=768)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    shape = (a.rows, a.cols)
    base = {n: rng.standard_normal(shape, dtype=np.float32) for n in ("P", "G", "M")}
    base["V"] = rng.random(shape, dtype=np.float32)
    values = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01,
              "step": 1, "decoupled": 1}  # fmt: skip
    hyper = np.array([values[n] for n in HYPER_NAMES], dtype=np.float32)
    rows = []
    for label, transposed in (("gradient [rows, cols]", False), ("gradient^T [cols, rows]", True)):
        arrays = {k: v.copy() for k, v in base.items()}
        if transposed:
            arrays["G"] = np.ascontiguousarray(base["G"].T)
        arrays |= {"H": hyper, "L": np.array(1.0, dtype=np.float32)}
        sess, binding = _session(arrays, transposed, a.threads)
        times = []
        for i in range(a.warmup + a.steps):
            t0 = time.perf_counter()
            sess.run_with_iobinding(binding)
            if i >= a.warmup:
                times.append(time.perf_counter() - t0)
        rows.append((label, statistics.median(times) * 1e3, min(times) * 1e3))
    print(f"AdamStep over [{a.rows}, {a.cols}], {a.threads} threads, {a.steps} steps\n")
    print("| gradient | median ms | best ms | vs plain |\n|---|---:|---:|---:|")
    for label, med, best in rows:
        print(f"| {label} | {med:.1f} | {best:.1f} | {med / rows[0][1]:.2f}x |")


if __name__ == "__main__":
    main()
