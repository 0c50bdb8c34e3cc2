#!/usr/bin/env bash
# Set up .venv, create the demo's tiny model and toy data offline, and train with GRPO on 2 CPU ranks.
# Extra arguments go to train_grpo.py, e.g. --trainer.total_steps 10 --trainer.output_dir outputs/x
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/python scripts/prepare_demo.py --out demo_assets
# Held-out greedy accuracy before training and every 25 steps (the YAML leaves validation off so
# tests can reuse it without validation data).
exec .venv/bin/torchrun --standalone --nproc_per_node=${NPROC:-2} train_grpo.py --config configs/demo_cpu.yaml \
  --trainer.val_before_train true --trainer.val_every 25 "$@"
