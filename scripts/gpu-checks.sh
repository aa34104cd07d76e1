#!/usr/bin/env bash
# On a GPU machine: the CUDA kernels, the GPU tests and the GPU benchmarks of this checkout.
#   bash scripts/gpu-checks.sh [tests|bench|all]       logs and JSON under ${OUT:-gpu-out}/
# Expects onnxruntime-gpu in /tmp/site (../shared/device/install-ort-gpu.sh) and, when
# carried, the wheels of scripts/gpu-wheels.sh in .whl/. Exits non-zero if a test fails.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
case "$what" in tests|bench|all) ;; *) echo "usage: $0 [tests|bench|all]" >&2; exit 2 ;; esac
out=${OUT:-gpu-out}
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:.${PYTHONPATH:+:$PYTHONPATH}
python3 - <<'PY' || exit 2
import onnxruntime as ort, torch
assert torch.cuda.is_available(), "torch sees no GPU"
assert "CUDAExecutionProvider" in ort.get_available_providers(), ort.get_available_providers()
print("onnxruntime", ort.__version__, "torch", torch.__version__, torch.cuda.get_device_name())
PY
if [ ! -f build/libortrain_kernels_cuda.so ]; then
  arch=$(python3 -c "import torch; a, b = torch.cuda.get_device_capability(); print(f'{a}{b}')")
  { cmake -S . -B build -DCMAKE_CUDA_ARCHITECTURES="$arch" -DCMAKE_BUILD_TYPE=Release &&
    cmake --build build -j; } > "$out/kernels-build.log" 2>&1 || { tail "$out/kernels-build.log"; exit 1; }
fi
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  PYTHONUNBUFFERED=1 python3 -m pytest -q -p no:cacheprovider -p no:logging -ra --tb=short \
    tests/test_cuda_kernels.py tests/test_cuda_training.py tests/test_mixed_precision.py \
    tests/test_fused_update.py tests/test_forked_build.py > "$out/gpu-tests.log" 2>&1
  rc=$?
  tail -15 "$out/gpu-tests.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  PYTHONUNBUFFERED=1 python3 benchmarks/bench_train.py --device cuda --workload gpt2-small-512 \
    --workload bert-base --backends torch,ortrain,ortrain-cudagraph,ortrain-fp16,torch-amp-fp16 \
    --threads 8 --steps 20 --warmup 5 --json "$out/bench.json" > "$out/bench.log" 2>&1 || rc=1
  grep "^|" "$out/bench.log" | head -20
fi
exit $rc
