#!/usr/bin/env bash
# Here (with package access): the pure-Python and small wheels a GPU machine without a
# package index needs so that it runs this checkout with the versions we test with:
# onnx, onnx-ir, onnxscript and transformers as installed here, for its Python 3.12.
# onnxruntime-gpu itself travels in chunks: scripts/device/prepare-ort-gpu.sh.
# Afterwards .whl/ (git-ignored) holds them; carry it and run scripts/gpu-checks.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
pins=$(python -m pip list --format=freeze 2>/dev/null | grep -iE '^(onnx|onnx-ir|onnx_ir|onnxscript|transformers)==')
rm -rf .whl && mkdir -p .whl
# shellcheck disable=SC2086
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $pins
ls -la .whl
