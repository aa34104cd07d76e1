#!/usr/bin/env bash
# The one prepared check for a bare GPU machine (issue 37), within a total time budget:
#   install   onnxruntime-gpu from the chunks in /tmp/ortgpu (scripts/device/), if there
#   provider  a real session runs on CUDAExecutionProvider (not the provider list)
#   kernels   cuda_kernels/ built for this GPU's architecture
#   tests     the GPU tests
#   probes    the predicted-defect probes (tests/test_cuda_training.py -k probe) and their
#             CPU stand-ins (tests/test_gpu_path.py)
#   dp        data parallel and ZeRO-1, -2, -3 through the reducer, world size 1, NCCL (torchrun)
#   bench     benchmarks/bench_gpu.py with what is left of the budget
# then $OUT/gpu-checks.json and $OUT/gpu-checks.md (each step: status, seconds, budget, the
# tail of its log; the benchmark's tables). A step that runs over its budget is cut and
# reported as cut, one the total left no time for as skipped; the exit status is 0 only
# when every step chosen ran and passed.
#
#   bash scripts/gpu-checks.sh [--dry-run] [--total-s 480] [--steps install,provider,...]
#
# --dry-run rehearses the same steps on CPU (GPU tests skip, gloo instead of NCCL, the
# benchmark's tiny models, kernels built into $OUT). Budgets: BUDGET_<step>=seconds;
# BENCH_ARGS: extra arguments for bench_gpu.py. Logs and results go to ${OUT:-gpu-out}/.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0 total=480 steps=install,provider,kernels,tests,probes,dp,bench
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --total-s) total=$2; shift ;;
    --steps) steps=$2; shift ;;
    *) echo "usage: $0 [--dry-run] [--total-s SECONDS] [--steps a,b,...]" >&2; exit 2 ;;
  esac
  shift
done
out=${OUT:-gpu-out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
start=$(date +%s)
deadline=$((start + total))
: > "$out/steps.tsv"
export PYTHONPATH=/tmp/site:.${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export dry out deadline
pytest_q() { python3 -m pytest -q -p no:cacheprovider -p no:logging -ra --tb=short "$@"; }

# run_step NAME DEFAULT_BUDGET_S FUNCTION: run it (in a child bash: timeout runs programs)
# under the smaller of its budget and what is left of the total; record name, status,
# seconds, budget.
run_step() {
  local name=$1 budget=$2 fn=$3
  case ",$steps," in *",$name,"*) ;; *) return 0 ;; esac
  local var="BUDGET_$name"
  budget=${!var:-$budget}
  local left=$((deadline - $(date +%s)))
  [ "$budget" -le "$left" ] || budget=$left
  if [ "$budget" -lt 5 ]; then
    printf '%s\tskipped\t0\t%s\tthe total budget of %s s was spent\n' "$name" "$budget" "$total" \
      >> "$out/steps.tsv"
    return 0
  fi
  local t0 rc status
  t0=$(date +%s)
  echo "== $name (budget ${budget} s)"
  timeout --kill-after=10 "$budget" bash -c "$fn" > "$out/$name.log" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124 | 137) status=cut ;;
    *) status=failed ;;
  esac
  printf '%s\t%s\t%s\t%s\texit %s\n' "$name" "$status" "$(($(date +%s) - t0))" "$budget" "$rc" \
    >> "$out/steps.tsv"
  tail -3 "$out/$name.log"
}

step_install() {
  if [ "$dry" = 1 ]; then
    echo "dry run: the chunk -> join -> verify -> install path is rehearsed by"
    echo "tests/test_device_handoff.py; here only the carried .whl/ wheels would install"
    return 0
  fi
  if compgen -G ".whl/*.whl" > /dev/null; then  # scripts/gpu-wheels.sh
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || return 1
  fi
  if [ -f /tmp/site/onnxruntime/__init__.py ]; then
    echo "onnxruntime already in /tmp/site"
    return 0
  fi
  # parts carried in earlier calls were copied to /tmp/ortgpu then; this call's, now
  if compgen -G ".ortgpu/*/part_*" > /dev/null; then
    mkdir -p /tmp/ortgpu && cp .ortgpu/*/part_* .ortgpu/*/MANIFEST /tmp/ortgpu/
  fi
  local script=scripts/device/install-ort-gpu.sh
  if ! compgen -G "/tmp/ortgpu/part_*" > /dev/null; then
    echo "no chunks in /tmp/ortgpu: onnxruntime as installed (the provider step checks it)"
    return 0
  fi
  bash "$script"
}

step_provider() {
  DRY=$dry python3 - <<'PY'
import os, sys
import torch
import onnxruntime as ort
from ortrain.runtime.session import cuda_unavailable_reason

print("onnxruntime", ort.__version__, "from", ort.__file__)
print("torch", torch.__version__, "CUDA", torch.version.cuda)
why = cuda_unavailable_reason()
if why is None:
    print("CUDAExecutionProvider runs a real session on", torch.cuda.get_device_name())
    sys.exit(0)
print("no CUDA session:", why)
sys.exit(0 if os.environ["DRY"] == "1" else 1)
PY
}

step_kernels() {
  local build=build arch=80
  if [ "$dry" = 1 ]; then
    build=$out/build-dry  # a scratch build: the checkout's build/ is left alone
  else
    [ -f build/libortrain_kernels_cuda.so ] && { echo "kernels already built"; return 0; }
    arch=$(python3 -c "import torch; a, b = torch.cuda.get_device_capability(); print(f'{a}{b}')")
  fi
  cmake -S . -B "$build" -DCMAKE_CUDA_ARCHITECTURES="$arch" -DCMAKE_BUILD_TYPE=Release &&
    cmake --build "$build" -j "$(nproc)"
}

step_tests() {
  # the CUDA test files and the forked build whole; of the mixed-precision and fused-update
  # files, their GPU tests (tests/conftest.py marks them "gpu"), not the CPU ones CI runs
  local rc=0
  pytest_q tests/test_cuda_kernels.py tests/test_cuda_training.py tests/test_forked_build.py \
    -k "not probe" || rc=1
  if grep -q '"gpu:' pyproject.toml; then
    pytest_q tests/test_fused_update.py tests/test_mixed_precision.py -m gpu
  else
    pytest_q tests/test_fused_update.py tests/test_mixed_precision.py
  fi
  case $? in 0 | 5) ;; *) rc=1 ;; esac  # 5: none selected
  return $rc
}

step_probes() {
  # (PROBES_SELECT narrows the -k selection: the test suite's dry run of this script, whose
  # own run has the CPU side of these tests)
  pytest_q tests/test_cuda_training.py -k probe &&
    pytest_q tests/test_gpu_path.py -k "${PROBES_SELECT:-not world_of_one and not gpu_checks}"
}

step_dp() {
  # one rank: the reducer's collectives over NCCL on the GPU (gloo in a dry run)
  # (DP_SELECT narrows the -k selection: the test suite's dry run of this script)
  torchrun --standalone --nproc_per_node 1 -m pytest -q -p no:cacheprovider -ra \
    tests/test_gpu_path.py -k "${DP_SELECT:-world_of_one}"
}

step_bench() {
  local left=$((deadline - $(date +%s) - 15))  # leaves time for the summary
  # shellcheck disable=SC2086
  python3 benchmarks/bench_gpu.py $([ "$dry" = 1 ] && echo --dry-run) --out "$out/bench" \
    --budget-s "$left" ${BENCH_ARGS:-}
}

export -f pytest_q step_install step_provider step_kernels step_tests step_probes step_dp step_bench
run_step install 45 step_install
run_step provider 40 step_provider
run_step kernels 90 step_kernels
run_step tests 200 step_tests
run_step probes 60 step_probes
run_step dp 45 step_dp
run_step bench "$total" step_bench

DRY=$dry TOTAL=$total START=$start python3 - "$out" <<'PY'
import json, os, sys, time
from pathlib import Path

out = Path(sys.argv[1])
steps = []
for line in (out / "steps.tsv").read_text().splitlines():
    name, status, seconds, budget, note = line.split("\t")
    log = out / f"{name}.log"
    tail = log.read_text(errors="replace").splitlines()[-15:] if log.is_file() else []
    steps.append({"step": name, "status": status, "seconds": int(seconds),
                  "budget_s": int(budget), "note": note, "log": log.name, "tail": tail})
bench = out / "bench" / "bench.json"
result = {
    "dry_run": os.environ["DRY"] == "1",
    "total_budget_s": int(os.environ["TOTAL"]),
    "used_s": int(time.time()) - int(os.environ["START"]),
    "steps": steps,
    "bench": json.loads(bench.read_text()) if bench.is_file() else None,
}
(out / "gpu-checks.json").write_text(json.dumps(result, indent=1))
md = [f"# GPU checks{' (dry run on CPU)' if result['dry_run'] else ''}", "",
      f"Used {result['used_s']} s of {result['total_budget_s']} s.", "",
      "| step | status | seconds | budget s | note |", "|---|---|---:|---:|---|"]
md += [f"| {s['step']} | {s['status']} | {s['seconds']} | {s['budget_s']} | {s['note']} |"
       for s in steps]
for s in steps:
    if s["status"] != "ok" and s["tail"]:
        md += ["", f"## {s['step']}: {s['status']}", "", "```", *s["tail"], "```"]
if (out / "bench" / "bench.md").is_file():
    md += ["", (out / "bench" / "bench.md").read_text()]
(out / "gpu-checks.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
sys.exit(0 if all(s["status"] == "ok" for s in steps) else 1)
PY
