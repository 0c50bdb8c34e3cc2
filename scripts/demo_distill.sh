#!/usr/bin/env bash
# On-policy distillation on 2 CPU ranks, the demo's toy task: why people use it, measured.
#   1. a teacher made here: the demo's tiny Qwen3 trained by GRPO for 60 steps (greedy accuracy ~0.9)
#   2. the same base model as the student, one run after the other with the same training-time budget:
#      GRPO alone, distillation alone (reverse KL, reward_weight 0), both (reward_weight 1), and GKD's
#      top-k JSD alone; held-out greedy accuracy every 5 steps against steps and training minutes
#      (scripts/bench_learning.py: its tables, outputs/demo_distill/learning.png and summary.json).
#   bash scripts/demo_distill.sh [--budget-min 1.0]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${OUT:-outputs/demo_distill}
[ -f demo_assets/tiny_qwen3/config.json ] || "$PY" scripts/prepare_demo.py --out demo_assets
TEACHER="$OUT/teacher/hf_final"
if [ ! -f "$TEACHER/config.json" ]; then
  "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 train_grpo.py --config configs/demo_cpu.yaml \
    --trainer.total_steps 60 --trainer.val_every 20 --trainer.output_dir "$OUT/teacher" --checkpoint.resume never
fi
"$PY" scripts/bench_learning.py --config configs/demo_cpu.yaml --out "$OUT" --val-every 5 --val-samples 200 \
  --budget-min 1.0 "$@" \
  --run grpo= \
  --run distill="--distill.teacher $TEACHER --distill.reward_weight 0" \
  --run both="--distill.teacher $TEACHER --distill.reward_weight 1" \
  --run topk_jsd="--distill.teacher $TEACHER --distill.reward_weight 0 --distill.mode topk"
