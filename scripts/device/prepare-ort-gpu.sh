#!/usr/bin/env bash
# Here, with package access: onnxruntime-gpu cut into chunks that each fit one transfer to a
# GPU machine without a package index (transfers are capped at 64 MiB).
# Run from the project root. Leaves .ortgpu/1 .. .ortgpu/N (git-ignored), each holding one
# part, the MANIFEST (wheel name, size, SHA-256, chunk count, then one line per part) and
# install-ort-gpu.sh, so that whichever folder arrives last can join and check them all.
#   ORTGPU_WHEEL  a wheel already on disk instead of downloading one
#   ORTGPU_CHUNK  the part size for split -b (default 61m: a ~250 MB wheel in four parts)
set -euo pipefail
ver=${1:-1.31.1}
chunk=${ORTGPU_CHUNK:-61m}
here=$(cd "$(dirname "$0")" && pwd)
rm -rf .ortgpu && mkdir -p .ortgpu/dl
if [ -n "${ORTGPU_WHEEL:-}" ]; then
  [ -f "$ORTGPU_WHEEL" ] || { echo "ORTGPU_WHEEL=$ORTGPU_WHEEL: no such file" >&2; exit 2; }
  cp "$ORTGPU_WHEEL" .ortgpu/dl/
else
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    -d .ortgpu/dl "onnxruntime-gpu==$ver"
fi
whl=$(ls .ortgpu/dl/*.whl)
split -b "$chunk" -d "$whl" .ortgpu/part_
parts=(.ortgpu/part_*)
n=${#parts[@]}
{
  echo "name $(basename "$whl")"
  echo "size $(stat -c %s "$whl")"
  echo "sha256 $(sha256sum "$whl" | cut -d' ' -f1)"
  echo "chunks $n"
  for p in "${parts[@]}"; do
    echo "part $(basename "$p") $(stat -c %s "$p") $(sha256sum "$p" | cut -d' ' -f1)"
  done
} > .ortgpu/MANIFEST
i=0
for p in "${parts[@]}"; do
  i=$((i + 1))
  mkdir -p ".ortgpu/$i"
  mv "$p" ".ortgpu/$i/"
  cp .ortgpu/MANIFEST "$here/install-ort-gpu.sh" ".ortgpu/$i/"
done
rm -rf .ortgpu/dl
echo "chunks: $n (wheel $(basename "$whl"), parts of $chunk)"
cat <<EOT
Carry the folders one transfer each (the device tool: carry [".ortgpu/k"]); on the GPU machine:
  mkdir -p /tmp/ortgpu && cp .ortgpu/k/part_* .ortgpu/k/MANIFEST /tmp/ortgpu/
and after the last one:  bash .ortgpu/$n/install-ort-gpu.sh
EOT
