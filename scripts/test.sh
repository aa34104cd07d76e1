#!/usr/bin/env bash
# Set up, lint, and run the test suite (what CI runs). Arguments go to pytest:
#   bash scripts/test.sh                  # everything (CI)
#   bash scripts/test.sh -m "not slow"    # the fast lane, while working (a few minutes)
#   bash scripts/test.sh -m gpu           # the CUDA tests, on a machine with a GPU
#   bash scripts/test.sh -n 0             # in this process only (no parallel workers)
# The tests run on one pytest-xdist worker per core this process may use (ORTRAIN_TEST_WORKERS
# overrides it; your own -n / --numprocesses / -p no:xdist wins), tests sharing a built
# fixture on one worker (--dist loadgroup); tests/conftest.py gives each worker its share of
# the cores' threads. The whole run's time is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/setup.sh
ruff check .
parallel=()
case " $* " in
  *" -n "* | *" -n"[0-9]* | *" --numprocesses"* | *" -p no:xdist "* | *" -pno:xdist "*) ;;
  *)
    # one per core, at most one per 3 GiB of available memory (a worker's end-to-end tests
    # hold torch, transformers and ONNX Runtime sessions: about 1-2 GiB)
    workers=${ORTRAIN_TEST_WORKERS:-$(python -c 'import os, psutil
print(max(1, min(len(os.sched_getaffinity(0)), psutil.virtual_memory().available // (3 * 2**30))))')}
    parallel=(-n "$workers" --dist loadgroup)
    ;;
esac
rc=0
python -m pytest -q -p no:cacheprovider ${parallel[@]+"${parallel[@]}"} "$@" || rc=$?
echo "scripts/test.sh: $(($(date +%s) - start)) s in all (setup, ruff, pytest), exit status $rc"
exit $rc
