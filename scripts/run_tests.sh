#!/usr/bin/env bash
# Set up .venv and run the test suite (CPU only; real VeOmni, vLLM and torch.distributed on gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
