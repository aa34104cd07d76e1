"""Two source trees of ortrain side by side: the same workloads, one run, alternating.

For a change that should not move performance (a restructuring), run the tree before it
and the tree after it in one session, so machine drift hits both alike: each repeat runs
every (workload, tree) pair once, in alternating order, each in its own process
(``bench_train.py``'s child mode from that tree, its own ``PYTHONPATH``, the on-disk
graph cache off). A development install (``pip install -e .``) puts a finder in front of
``PYTHONPATH`` that maps ``ortrain`` to its own checkout: the child drops it and checks
that ``ortrain`` comes from the tree under test. Each tree's native libraries are built
with CMake into a folder of their own (``ORTRAIN_NATIVE_DIR``). The table gives per pair
the median over repeats of the median step time and the peak RSS, after / before of those
medians, and the median and range of the per-repeat ratios (after over before in the same
repeat, run back to back, so slow drift of the machine cancels in each ratio).

Usage::

    git worktree add /tmp/before <commit>
    python benchmarks/bench_commits.py --before /tmp/before --after . --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hardware import cpu_description

# Runs a script as __main__ with the editable install's finder removed, after checking that
# ortrain is imported from the tree under test.
_LAUNCH = """
import os, runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if "Redirecting" not in type(f).__name__]
import ortrain
tree = os.environ["BENCH_TREE"]
assert ortrain.__file__.startswith(tree + os.sep), (ortrain.__file__, tree)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def build_native(tree: Path, dest: Path) -> Path:
    """The tree's native libraries, built with CMake into ``dest`` (once)."""
    if not any(dest.glob("libortrain_cpu_ops*.so")):
        for cmd in (
            ["cmake", "-S", str(tree), "-B", str(dest), "-DCMAKE_BUILD_TYPE=Release",
             "-DORTRAIN_KERNELS_CUDA=OFF"],
            ["cmake", "--build", str(dest), "-j"],
        ):  # fmt: skip
            subprocess.run(cmd, check=True, capture_output=True)
    return dest


def run_once(
    tree: Path, native: Path, workload: str, backend: str, args: argparse.Namespace
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable, "-c", _LAUNCH, str(tree / "benchmarks" / "bench_train.py"),
            "--backend", backend, "--workload", workload, "--json", str(out),
            "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--threads", str(args.threads), "--dropout", str(args.dropout),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(tree), "ORTRAIN_GRAPH_CACHE": "0",
               "BENCH_TREE": str(tree), "ORTRAIN_NATIVE_DIR": str(native)}  # fmt: skip
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-4000:])
            raise SystemExit(f"{tree}: {backend} / {workload} failed (exit {proc.returncode})")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", type=Path, required=True, help="source tree before the change")
    p.add_argument("--after", type=Path, required=True, help="source tree after the change")
    p.add_argument("--workloads", default="gpt2-tiny,bert-tiny")
    p.add_argument("--backend", default="ortrain")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.0, help="all dropout probabilities")
    p.add_argument("--json", type=Path, help="write every run's result here")
    p.add_argument("--native-root", type=Path, default=Path(tempfile.gettempdir()) / "bench-native")
    args = p.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    workloads = [w for w in args.workloads.split(",") if w]
    native = {n: build_native(t, args.native_root / n) for n, t in trees.items()}
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.repeats):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for w in workloads:
            for name in order:
                result = run_once(trees[name], native[name], w, args.backend, args)
                runs.setdefault((w, name), []).append(result)
                print(
                    f"[{r + 1}/{args.repeats}] {w} {name}: "
                    f"{result['median_step_s'] * 1e3:.1f} ms, {result['peak_rss_mib']:.0f} MiB",
                    flush=True,
                )
    print(f"\nCPU: {cpu_description()}; backend {args.backend}, {args.threads} threads, "
          f"{args.repeats} repeats x {args.steps} steps")  # fmt: skip
    print(
        "| workload | before ms | after ms | after/before | paired ratio (range) "
        "| before MiB | after MiB |"
    )
    print("|---|---|---|---|---|---|---|")
    for w in workloads:
        t = {n: statistics.median(x["median_step_s"] for x in runs[(w, n)]) for n in trees}
        m = {n: statistics.median(x["peak_rss_mib"] for x in runs[(w, n)]) for n in trees}
        pairs = [
            a["median_step_s"] / b["median_step_s"]
            for a, b in zip(runs[(w, "after")], runs[(w, "before")], strict=True)
        ]
        print(
            f"| {w} | {t['before'] * 1e3:.1f} | {t['after'] * 1e3:.1f} | "
            f"{t['after'] / t['before']:.3f} | {statistics.median(pairs):.3f} "
            f"({min(pairs):.3f}-{max(pairs):.3f}) | {m['before']:.0f} | {m['after']:.0f} |"
        )
    if args.json:
        data = {f"{w}/{n}": v for (w, n), v in runs.items()}
        args.json.write_text(json.dumps({"cpu": cpu_description(), "runs": data}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
