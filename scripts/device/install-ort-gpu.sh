#!/usr/bin/env bash
# On the GPU machine, once every part reached the chunk folder: check each part against the
# MANIFEST, join them, check the wheel, install it into a prefix of its own and check that
# it works. Nothing is installed unless every check passes.
#   ORTGPU_CHUNKS  where the parts and MANIFEST are (default /tmp/ortgpu)
#   ORTGPU_PREFIX  the install prefix, to prepend to PYTHONPATH (default /tmp/site)
#   ORTGPU_CHECK   cuda (default: a real session on CUDAExecutionProvider) or import:MODULE
# Exit codes: 2 no MANIFEST, 3 a part missing, 4 a part or the joined wheel damaged,
# 5 the install check failed.
set -euo pipefail
chunks=${ORTGPU_CHUNKS:-/tmp/ortgpu}
prefix=${ORTGPU_PREFIX:-/tmp/site}
check=${ORTGPU_CHECK:-cuda}
manifest="$chunks/MANIFEST"
[ -f "$manifest" ] || { echo "no MANIFEST in $chunks: copy one chunk folder's MANIFEST there" >&2; exit 2; }
name=$(awk '$1 == "name" {print $2}' "$manifest")
size=$(awk '$1 == "size" {print $2}' "$manifest")
sha=$(awk '$1 == "sha256" {print $2}' "$manifest")
count=$(awk '$1 == "chunks" {print $2}' "$manifest")
missing=() damaged=()
while read -r _ part psize psha; do
  f="$chunks/$part"
  if [ ! -f "$f" ]; then
    missing+=("$part")
    continue
  fi
  got=$(stat -c %s "$f")
  if [ "$got" != "$psize" ] || [ "$(sha256sum "$f" | cut -d' ' -f1)" != "$psha" ]; then
    damaged+=("$part ($got of $psize bytes)")
  fi
done < <(awk '$1 == "part"' "$manifest")
if [ ${#missing[@]} -gt 0 ]; then
  echo "missing chunk(s) ${missing[*]} in $chunks: ${#missing[@]} of $count not received" >&2
  exit 3
fi
if [ ${#damaged[@]} -gt 0 ]; then
  printf -v list '%s, ' "${damaged[@]}"
  echo "corrupted chunk(s): ${list%, } in $chunks: send them again" >&2
  exit 4
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
wheel="$work/$name"
awk '$1 == "part" {print $2}' "$manifest" | while read -r part; do cat "$chunks/$part"; done > "$wheel"
got=$(stat -c %s "$wheel")
if [ "$got" != "$size" ] || [ "$(sha256sum "$wheel" | cut -d' ' -f1)" != "$sha" ]; then
  echo "the joined wheel $name does not match the MANIFEST ($got of $size bytes)" >&2
  exit 4
fi
python3 -m pip install -q --no-index --no-deps --no-compile --target "$prefix" "$wheel"
if [ "${check%%:*}" = import ]; then
  module=${check#import:}
  PYTHONPATH="$prefix" python3 -c "
import sys, $module
where = $module.__file__
if not where.startswith('$prefix'):
    sys.exit(f'$module imports from {where}, not from $prefix')
print('$module imports from $prefix')
" || exit 5
else
  PYTHONPATH="$prefix" python3 - <<'PY' || exit 5
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

try:
    ort.preload_dlls()  # the CUDA / cuDNN libraries torch ships
except Exception as e:  # older onnxruntime: the libraries must be on the loader path
    print("preload_dlls:", e)
graph = helper.make_graph(
    [helper.make_node("Relu", ["x"], ["y"])], "probe",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
# onnx's default IR version can be newer than the wheel reads (onnx 1.23 writes 14,
# onnxruntime 1.31 reads up to 13): the check is of the provider, not of the IR
model.ir_version = 8
session = ort.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider"])
if session.get_providers()[0] != "CUDAExecutionProvider":
    sys.exit(f"onnxruntime {ort.__version__} fell back to {session.get_providers()}: "
             "the CUDA libraries were not found")
session.run(None, {"x": np.ones(4, np.float32)})
print("onnxruntime", ort.__version__, "runs a session on CUDAExecutionProvider")
PY
fi
echo "installed $name into $prefix: export PYTHONPATH=$prefix:\$PYTHONPATH (and call onnxruntime.preload_dlls() before creating sessions)"
