#!/usr/bin/env bash
# Install ortrain and its dependencies into the current Python environment.
# torch first, pinned to the CPU build, so nothing pulls a CUDA build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check "torch==2.13.0"
python -m pip install -q --disable-pip-version-check -e ".[dev,recipes]"
