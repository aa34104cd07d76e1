#!/usr/bin/env bash
# Set up, lint, and run the test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ruff check .
python -m pytest -q -p no:cacheprovider "$@"
