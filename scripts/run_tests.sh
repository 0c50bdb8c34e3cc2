#!/usr/bin/env bash
# Set up .venv and run the test suite (CPU only; real VeOmni, vLLM and torch.distributed on gloo).
#   bash scripts/run_tests.sh                        the whole suite: both phases below
#   bash scripts/run_tests.sh tests/test_grpo_options.py   one file (any pytest arguments), in one process
#   bash scripts/run_tests.sh -m unit                the unit set
# The whole suite runs in two phases (docs/testing.md): every test not marked serial on
# $PYTEST_WORKERS workers (pytest-xdist, default 2: the CI machine's cores), one file per worker at
# a time so that a file's module fixtures are built once; then the serial tests (wall-clock bounds
# that another worker's load would blur) alone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Every launch imports rlcore: without bytecode caches (a container's PYTHONDONTWRITEBYTECODE=1)
# each of its ~300 processes compiles the ~50 modules again (0.1 s of CPU each).
unset PYTHONDONTWRITEBYTECODE
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider)
if [ "$#" -gt 0 ]; then
  exec "${pytest[@]}" --durations=15 "$@"
fi
rc=0
"${pytest[@]}" -n "${PYTEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=25 -m "not serial" tests || rc=$?
serial=0
"${pytest[@]}" --durations=5 -m serial tests || serial=$?
[ "$serial" -eq 5 ] && serial=0  # none marked serial: nothing to run
[ "$rc" -ne 0 ] && exit "$rc"
exit "$serial"
