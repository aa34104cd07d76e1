#!/usr/bin/env bash
# Install ortrain and its dependencies into the current Python environment.
# torch first, pinned to the CPU build, so nothing pulls a CUDA build of torch; then the
# project itself, editable: its build (scikit-build-core + CMake, pyproject.toml) compiles
# the native libraries (CPU ops, optimizer kernels, the CUDA kernels where nvcc is found).
set -euo pipefail
cd "$(dirname "$0")/.."
pip=(python -m pip install -q --disable-pip-version-check)
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" -e ".[dev,recipes]"
