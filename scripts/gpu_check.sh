#!/usr/bin/env bash
# shellcheck disable=SC1091  # CANN's set_env.sh scripts are not part of this repository
# First thing to run on a new GPU (or Ascend NPU) machine, before any real job. Short GRPO runs of
# the tiny offline demo models (scripts/prepare_demo.py), one after the other, each on the
# accelerator path a real run takes (bf16, trainer parameters and optimizer offloaded while vLLM
# generates, direct weight loading, CUDA graphs), then ONE JSON line with pass/fail per part and
# overall. The parts (PARTS picks them and their order; default all, as listed):
#   base    the dense tiny Qwen3, vLLM sleep level 2: memory per phase, the largest trainer-vs-vLLM
#           log-prob difference after the weight sync, step time
#   judge   base + a model-based reward (reward.models: the tiny reward model on its own in-process
#           vLLM engine, woken and put to sleep around every scoring)
#   lora    base + a rank-8 LoRA adapter (sleep level 1: vLLM keeps its base weights in host memory;
#           only the adapter is synced)
#   moe     the tiny Qwen3-MoE (4 experts, top-2; EP = the rank count), vLLM sleep level 2: the experts
#           sleep, wake (vllm-ascend 0.23 swaps them for transposed views; the rollout puts them back:
#           rollout/experts_restored, 4 on NPU, 0 on CUDA), are synced (weight_load reload) and generate;
#           the trainer-vs-vLLM log-prob difference after each sync is the verdict. Its checkpoint has
#           per-expert names (transformers' save_pretrained): the sync sends them as the engine's loader
#           takes them (experts_sync: per-expert on NPU, whose vllm 0.23 Qwen3-MoE drops fused names,
#           fused on CUDA) and the first sync raises if vLLM dropped any tensor
#   ulysses the dense tiny Qwen3 with Ulysses sequence parallelism over 2 ranks (parallel.ulysses_size 2)
#           and the device's own attention kernel (auto: flash-attn-4 on Hopper/Blackwell, npu_fusion_attention
#           on Ascend: VeOmni's Ulysses flash path with the row's cu_seq_lens); needs 2 devices
#   teacher base + on-policy distillation (distill.teacher: the tiny Qwen3 itself on a third in-process vLLM
#           engine, asleep except while it scores every token): distill/reverse_kl every step
#   moe_r3  the tiny Qwen3-MoE with R3 routing replay (vLLM returns its routed experts, the trainer
#           replays them). Not in the seed recipe: on NPU it runs only when PARTS names it
# On NPU, before any part: vllm-ascend's custom ops must load on this SoC (PyPI's wheels carry Atlas A2
# kernels only): exit 2 naming the fix when they do not; the JSON line says which SoC passed.
#
#   bash scripts/gpu_check.sh                 # CUDA: 1 or 2 visible GPUs (CUDA_VISIBLE_DEVICES picks them)
#   DEVICE=npu bash scripts/gpu_check.sh      # Ascend NPUs (ASCEND_RT_VISIBLE_DEVICES picks them)
#   PARTS=base,lora bash scripts/gpu_check.sh # some parts only
#
# Needs the accelerator stack in .venv (requirements-cuda.txt or requirements-npu.txt; PYTHON=...
# for another interpreter). Exit code: 0 every part that ran passed, 1 a part failed, 2 no usable
# accelerator or environment (or an unknown part). Environment (all optional): PARTS, NPROC (visible
# devices, at most 2), TP (rollout tensor parallel size, default NPROC: 2 devices also test the
# sharded weight sync), MAX_LOGP_DIFF (1e-3, every part), MIN_ROUTER_AGREEMENT (0.5, moe_r3), STEPS
# (3, each part), GPU_MEM_UTIL (0.3: vLLM's share; the tiny models need little), OUT (default
# /tmp/rlcore_gpu_check.USER; part P logs to OUT/P/train.log), WEIGHT_LOAD (direct; moe_r3 always
# reloads), ENFORCE_EAGER (false). Extra arguments reach train_grpo.py in every part.
# PRINT_CONFIG=1 (or =PART) skips the device checks and only prints the trainer's config for the base
# part (or PART) with these arguments (the tests use it to keep each part's overrides in step with
# rlcore/config/sections.py).
set -euo pipefail
cd "$(dirname "$0")/.."

ALL_PARTS="base judge lora moe ulysses teacher moe_r3"
PARTS_GIVEN=${PARTS:+1}
DEVICE=${DEVICE:-cuda}
SMI=$([ "$DEVICE" = npu ] && echo "npu-smi info" || echo nvidia-smi)
refuse() { echo "gpu_check: $*" >&2; exit 2; }
known_part() { case " $ALL_PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

PARTS=${PARTS:-${ALL_PARTS// /,}}
IFS=', ' read -r -a PART_LIST <<< "$PARTS"
[ "${#PART_LIST[@]}" -gt 0 ] || refuse "PARTS is empty: name some of ${ALL_PARTS// /,}"
for part in "${PART_LIST[@]}"; do
    known_part "$part" || refuse "PARTS=$PARTS: unknown part '$part'; the parts: ${ALL_PARTS// /,}"
done
PRINT_PART=""
case "${PRINT_CONFIG:-0}" in
    0) ;;
    1) PRINT_PART=base ;;
    *) known_part "$PRINT_CONFIG" || refuse "PRINT_CONFIG=$PRINT_CONFIG: use 1 (the base part) or a part: ${ALL_PARTS// /,}"
       PRINT_PART=$PRINT_CONFIG ;;
esac

PYTHON=${PYTHON:-.venv/bin/python}
if [ -n "$PRINT_PART" ]; then
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
    if [ "$DEVICE" = npu ]; then  # vllm-ascend's custom ops on this SoC (MoE routing calls them)
        ops=$("$PYTHON" scripts/gpu_check_report.py --ascend-ops) || refuse "could not run $PYTHON"
        ASCEND_OPS=${ops##*$'\n'}
        case "$ASCEND_OPS" in ERROR*) refuse "${ASCEND_OPS#ERROR }" ;; esac
    fi
fi
NPROC=${NPROC:-$(( count < 2 ? count : 2 ))}
TP=${TP:-$NPROC}
STEPS=${STEPS:-3}
MAX_LOGP_DIFF=${MAX_LOGP_DIFF:-1e-3}
MIN_ROUTER_AGREEMENT=${MIN_ROUTER_AGREEMENT:-0.5}
OUT=${OUT:-/tmp/rlcore_gpu_check.${USER:-$(id -u)}}
JUDGE=high_digit  # the judge's reward component (scripts/gpu_check_report.py JUDGE reads reward/$JUDGE)

# ---------------------------------------------------------------------------------------------
# each part's train_grpo.py arguments: part_args PART [extra...] sets ARGS
# ---------------------------------------------------------------------------------------------

# What every part runs: the demo task on the dense tiny Qwen3 with the accelerator path.
common_args() {
    ARGS=(train_grpo.py --config configs/demo_cpu.yaml
        --model.path "$OUT/assets/tiny_qwen3"
        --data.train_files "[\"$OUT/assets/data/toy_train.jsonl\"]" --data.val_files "[]"
        --parallel.device "$DEVICE" --model.dtype bfloat16
        --offload.params true --offload.optimizer true
        --rollout.sleep_level 2 --rollout.weight_load "${WEIGHT_LOAD:-direct}"
        --rollout.enforce_eager "${ENFORCE_EAGER:-false}"
        --rollout.tensor_parallel_size "$TP" --rollout.gpu_memory_utilization "${GPU_MEM_UTIL:-0.3}"
        --rollout.n 8 --rollout.max_num_seqs 128
        --trainer.prompts_per_step 16 --trainer.total_steps "$STEPS" --trainer.output_dir "$OUT/$1/run"
        --trainer.val_before_train false --trainer.val_every 0
        --checkpoint.resume never --checkpoint.save_hf_final false)
}

base_args() { :; }

# The only reward is the tiny reward model's (configs/demo_judge_cpu.yaml's judge): a sequence-
# classification head on its own vLLM engine, scoring the response's first word.
judge_args() {
    local template="{{ response.split()[0] if response.split() else '?' }}"
    ARGS+=(--reward.components "{\"$JUDGE\": 1.0}"
        --reward.models "[{\"name\": \"$JUDGE\", \"path\": \"$OUT/assets/tiny_rm_high_digits\",
            \"kind\": \"discriminative\", \"template\": \"$template\", \"activation\": \"sigmoid\",
            \"pass_threshold\": 0.5, \"max_model_len\": 32}]")
}

# LoRA pushes only the adapter, so vLLM must keep its base weights (level 1). lr 1e-2 (as
# tests/test_lora.py) moves the adapter enough that a stale one shows in the mismatch from step 2.
lora_args() {
    ARGS+=(--lora.rank 8 --lora.alpha 16 --optim.lr 1e-2 --rollout.sleep_level 1)
}

# MoE weights reload (a direct load skips vLLM's post-load expert re-layout and is refused); sleep
# level 2 from common_args: each step's wake-up is where vllm-ascend 0.23 swaps the experts.
moe_args() {
    ARGS+=(--model.path "$OUT/assets/tiny_qwen3_moe" --parallel.ep_size "$NPROC" --rollout.weight_load reload)
}

# R3 needs vLLM's routed experts: prefix caching on (vLLM 0.32 requires it).
moe_r3_args() {
    moe_args
    ARGS+=(--rollout.enable_prefix_caching true --algorithm.routing_replay r3)
}

# The row split over 2 ranks; attention left to the device (auto), share_prompt off with a flash kernel.
ulysses_args() {
    ARGS+=(--parallel.ulysses_size 2 --model.attn_implementation auto)
}

# The teacher is the policy's own starting model (same tokenizer, checked before loading): what the part
# checks is the third engine's sleep, wake and scoring on the device, not what it teaches.
teacher_args() {
    ARGS+=(--distill.teacher "$OUT/assets/tiny_qwen3" --distill.reward_weight 1.0)
}

part_args() {
    local part=$1
    shift
    common_args "$part"
    "${part}_args"
    ARGS+=("$@")
}

# Why PART cannot run on this device (nothing when it can).
skip_reason() {
    if [ "$1" = ulysses ] && [ "$NPROC" -lt 2 ]; then
        echo "Ulysses sequence parallelism splits each row over 2 ranks; NPROC=$NPROC (one visible device)"
        return
    fi
    case "$1:$DEVICE" in
        moe_r3:npu) [ -n "$PARTS_GIVEN" ] \
                        || echo "R3 routing replay is not in the seed recipe, and whether vllm-ascend 0.23.0's model" \
                                "runner returns routed experts is vLLM's own check at start-up: PARTS=moe_r3 runs it" ;;
    esac
}

if [ -n "$PRINT_PART" ]; then
    part_args "$PRINT_PART" "$@"
    exec "$PYTHON" "${ARGS[@]}" --print_config
fi

# ---------------------------------------------------------------------------------------------
# the runs
# ---------------------------------------------------------------------------------------------

TORCHRUN=$(dirname "$PYTHON")/torchrun
[ -x "$TORCHRUN" ] || TORCHRUN=torchrun
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::FutureWarning}

# Runs PART; its outcome goes to REPORT_ARGS (--ran PART=EXIT_CODE or --skipped PART=REASON).
run_part() {
    local part=$1 rc=0 reason
    shift
    rm -rf "${OUT:?}/$part"
    reason=$(skip_reason "$part")
    if [ -n "$reason" ]; then
        echo "gpu_check: $part skipped: $reason" >&2
        REPORT_ARGS+=(--skipped "$part=$reason")
        return
    fi
    mkdir -p "$OUT/$part"
    part_args "$part" "$@"
    echo "gpu_check: $part: $STEPS steps (log: $OUT/$part/train.log)" >&2
    "$TORCHRUN" --standalone --nproc_per_node "$NPROC" "${ARGS[@]}" > "$OUT/$part/train.log" 2>&1 || rc=$?
    [ "$rc" -eq 0 ] || { echo "gpu_check: $part: the trainer exited $rc; the end of $OUT/$part/train.log:" >&2
                         tail -n 40 "$OUT/$part/train.log" >&2; }
    REPORT_ARGS+=(--ran "$part=$rc")
}

mkdir -p "$OUT"
echo "gpu_check: $DEVICE, $count visible, using $NPROC rank(s), rollout TP $TP; parts ${PARTS// /}; output in $OUT" >&2
"$PYTHON" scripts/prepare_demo.py --out "$OUT/assets" >&2

REPORT_ARGS=()
for part in "${PART_LIST[@]}"; do
    run_part "$part" "$@"
done

exec "$PYTHON" scripts/gpu_check_report.py --out "$OUT" "${REPORT_ARGS[@]}" --steps "$STEPS" \
    --max-logp-diff "$MAX_LOGP_DIFF" --min-router-agreement "$MIN_ROUTER_AGREEMENT" \
    --device "$DEVICE" --nproc "$NPROC" --tp "$TP" ${ASCEND_OPS:+--ascend-ops "$ASCEND_OPS"}
