#!/usr/bin/env bash
# shellcheck disable=SC1091  # CANN's set_env.sh scripts are not part of this repository
# First thing to run on a new GPU (or Ascend NPU) machine, before any real job: trains the tiny
# offline demo model for 3 GRPO steps with the accelerator path a real run takes (bf16, trainer
# parameters and optimizer offloaded while vLLM generates, vLLM sleep level 2, direct weight
# loading, CUDA graphs), then prints one JSON line: memory per phase, the largest trainer-vs-vLLM
# log-prob difference after the weight sync, step time, and "pass": true/false with the reasons.
#
#   bash scripts/gpu_check.sh                 # CUDA: 1 or 2 visible GPUs (CUDA_VISIBLE_DEVICES picks them)
#   DEVICE=npu bash scripts/gpu_check.sh      # Ascend NPUs (ASCEND_RT_VISIBLE_DEVICES picks them)
#
# Needs the accelerator stack in .venv (requirements-cuda.txt or requirements-npu.txt; PYTHON=...
# for another interpreter). Exit code: 0 pass, 1 fail, 2 no usable accelerator or environment.
# Environment (all optional): NPROC (visible devices, at most 2), TP (rollout tensor parallel size,
# default NPROC: 2 devices also test the sharded weight sync), MAX_LOGP_DIFF (1e-3), STEPS (3),
# GPU_MEM_UTIL (0.3: vLLM's share; the tiny model needs little), OUT (default /tmp/rlcore_gpu_check.USER),
# WEIGHT_LOAD (direct), ENFORCE_EAGER (false). Extra arguments reach train_grpo.py.
# PRINT_CONFIG=1 skips the device checks and only prints the trainer's resolved config for these
# arguments (the tests use it to keep the check's overrides in step with rlcore/config.py).
set -euo pipefail
cd "$(dirname "$0")/.."

DEVICE=${DEVICE:-cuda}
SMI=$([ "$DEVICE" = npu ] && echo "npu-smi info" || echo nvidia-smi)
refuse() { echo "gpu_check: $*" >&2; exit 2; }

PYTHON=${PYTHON:-.venv/bin/python}
if [ "${PRINT_CONFIG:-0}" = 1 ]; then
    case "$DEVICE" in cuda|npu) ;; *) refuse "DEVICE=$DEVICE: use cuda or npu" ;; esac
    count=${NPROC:-2}
else
    case "$DEVICE" in
        cuda)
            command -v nvidia-smi >/dev/null 2>&1 \
                || refuse "this machine has no NVIDIA GPU (nvidia-smi is not on PATH); run it on a GPU node" \
                          "(on an Ascend NPU node: DEVICE=npu bash scripts/gpu_check.sh)" ;;
        npu)
            command -v npu-smi >/dev/null 2>&1 \
                || refuse "this machine has no Ascend NPU (npu-smi is not on PATH); run it on an NPU node"
            # CANN's environment, as scripts/slurm/train_grpo.sbatch sets it
            ASCEND_HOME=${ASCEND_HOME:-/usr/local/Ascend}
            set +eu  # vendor scripts read unset variables
            if [ -z "${ASCEND_TOOLKIT_HOME:-}" ] && [ -f "$ASCEND_HOME/ascend-toolkit/set_env.sh" ]; then
                source "$ASCEND_HOME/ascend-toolkit/set_env.sh"
            fi
            if [ -z "${ATB_HOME_PATH:-}" ] && [ -f "$ASCEND_HOME/nnal/atb/set_env.sh" ]; then
                source "$ASCEND_HOME/nnal/atb/set_env.sh"
            fi
            set -eu
            export MULTI_STREAM_MEMORY_REUSE=${MULTI_STREAM_MEMORY_REUSE:-2}
            export TASK_QUEUE_ENABLE=${TASK_QUEUE_ENABLE:-1}
            export CPU_AFFINITY_CONF=${CPU_AFFINITY_CONF:-1} ;;
        *) refuse "DEVICE=$DEVICE: use cuda or npu" ;;
    esac

    [ -x "$PYTHON" ] || command -v "$PYTHON" >/dev/null 2>&1 \
        || refuse "no Python at $PYTHON: create .venv with requirements-$DEVICE.txt (see README) or set PYTHON"

    # The accelerator as torch sees it (drivers, CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES).
    probe=$("$PYTHON" scripts/gpu_check_report.py --probe "$DEVICE") || refuse "could not run $PYTHON"
    count=${probe##*$'\n'}  # the last line; libraries may print before it
    case "$count" in
        ERROR*) refuse "${count#ERROR }: install requirements-$DEVICE.txt into .venv and check the driver" \
                       "($SMI must list the devices)" ;;
        ''|*[!0-9]*) refuse "could not count the devices: $probe" ;;
    esac
fi
NPROC=${NPROC:-$(( count < 2 ? count : 2 ))}
TP=${TP:-$NPROC}
STEPS=${STEPS:-3}
MAX_LOGP_DIFF=${MAX_LOGP_DIFF:-1e-3}
OUT=${OUT:-/tmp/rlcore_gpu_check.${USER:-$(id -u)}}

ARGS=(train_grpo.py --config configs/demo_cpu.yaml
    --model.path "$OUT/assets/tiny_qwen3"
    --data.train_files "[\"$OUT/assets/data/toy_train.jsonl\"]" --data.val_files "[]"
    --parallel.device "$DEVICE" --model.dtype bfloat16
    --offload.params true --offload.optimizer true
    --rollout.sleep_level 2 --rollout.weight_load "${WEIGHT_LOAD:-direct}"
    --rollout.enforce_eager "${ENFORCE_EAGER:-false}"
    --rollout.tensor_parallel_size "$TP" --rollout.gpu_memory_utilization "${GPU_MEM_UTIL:-0.3}"
    --rollout.n 8 --rollout.max_num_seqs 128
    --trainer.prompts_per_step 16 --trainer.total_steps "$STEPS" --trainer.output_dir "$OUT/run"
    --trainer.val_before_train false --trainer.val_every 0
    --checkpoint.resume never --checkpoint.save_hf_final false
    "$@")
if [ "${PRINT_CONFIG:-0}" = 1 ]; then
    exec "$PYTHON" "${ARGS[@]}" --print_config
fi

TORCHRUN=$(dirname "$PYTHON")/torchrun
[ -x "$TORCHRUN" ] || TORCHRUN=torchrun
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::FutureWarning}

rm -rf "$OUT/run"
mkdir -p "$OUT"
echo "gpu_check: $DEVICE, $count visible, using $NPROC rank(s), rollout TP $TP; output in $OUT" >&2
"$PYTHON" scripts/prepare_demo.py --out "$OUT/assets" >&2

rc=0
"$TORCHRUN" --standalone --nproc_per_node "$NPROC" "${ARGS[@]}" > "$OUT/train.log" 2>&1 || rc=$?
[ "$rc" -eq 0 ] || { echo "gpu_check: the trainer exited $rc; the end of $OUT/train.log:" >&2; tail -n 40 "$OUT/train.log" >&2; }

exec "$PYTHON" scripts/gpu_check_report.py --run-dir "$OUT/run" --steps "$STEPS" --max-logp-diff "$MAX_LOGP_DIFF" \
    --rc "$rc" --log "$OUT/train.log" --device "$DEVICE" --nproc "$NPROC" --tp "$TP"
