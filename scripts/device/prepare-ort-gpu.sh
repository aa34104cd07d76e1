#!/usr/bin/env bash
# Here, with package access: onnxruntime-gpu cut into chunks that each fit one transfer to a
# GPU machine without a package index (transfers are capped at 64 MiB).
# Run from the project root. Leaves .ortgpu/1 .. .ortgpu/N (git-ignored), each holding one
# part, the MANIFEST (wheel name, size, SHA-256, chunk count, then one line per part) and
# install-ort-gpu.sh, so that whichever folder arrives last can join and check them all.
#   ORTGPU_WHEEL  a wheel already on disk instead of downloading one
#   ORTGPU_CHUNK  the part size for split -b; by default the largest that fits one transfer
#                 beside the working tree that travels with every call (the tracked and
#                 untracked-not-ignored files), the folder's MANIFEST and install script,
#                 and 1/256 of the limit to spare
#   ORTGPU_LIMIT  bytes one transfer may carry (default 64 MiB)
set -euo pipefail
ver=${1:-1.31.1}
here=$(cd "$(dirname "$0")" && pwd)
limit=${ORTGPU_LIMIT:-$((64 * 1024 * 1024))}
if [ -n "${ORTGPU_CHUNK:-}" ]; then
  chunk=$ORTGPU_CHUNK
else
  tree=0
  if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
    tree=$({ git ls-files -z; git ls-files -z -o --exclude-standard; } \
      | xargs -0 -r stat -c %s -- 2>/dev/null | awk '{n += $1} END {print n + 0}')
  fi
  chunk=$((limit - tree - $(stat -c %s "$here/install-ort-gpu.sh") - 4096 - limit / 256))
  if [ "$chunk" -le 0 ]; then
    echo "the working tree ($tree bytes) leaves no room for a part in a $limit-byte transfer" >&2
    exit 2
  fi
fi
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
echo "chunks: $n (wheel $(basename "$whl"), parts of $chunk bytes at most)"
cat <<EOT
Carry the folders one transfer each (the device tool: carry [".ortgpu/k"]); on the GPU machine:
  mkdir -p /tmp/ortgpu && cp .ortgpu/k/part_* .ortgpu/k/MANIFEST /tmp/ortgpu/
and after the last one:  bash .ortgpu/$n/install-ort-gpu.sh
EOT
