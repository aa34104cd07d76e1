#!/usr/bin/env bash
# Set up, lint, and run the test suite (what CI runs). Arguments go to pytest:
#   bash scripts/test.sh                  # everything (CI)
#   bash scripts/test.sh -m "not slow"    # the fast lane, while working (a few minutes)
#   bash scripts/test.sh -m gpu           # the CUDA tests, on a machine with a GPU
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ruff check .
python -m pytest -q -p no:cacheprovider "$@"
