"""The launch line of a converted run, runnable as printed from any directory: the repository's
torchrun and python by absolute path, the config's absolute path, the device the script targets
(Ascend from its own markers), and the environment the script exported sorted into kept, not
needed here and harmful here, each with its reason."""

from __future__ import annotations

import os
import re
import shlex
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ASCEND_MARKERS = re.compile(r"^(ASCEND_|HCCL_|TASK_QUEUE_ENABLE$|VLLM_ASCEND_|CPU_AFFINITY_CONF$|PYTORCH_NPU_)")

# (pattern, class, reason): the first pattern that matches an exported name decides
ENV_RULES = (
    (r"^PYTORCH_(CUDA|NPU)_ALLOC_CONF$", "alloc", "vLLM's sleep mode allocates through its own memory pool, which "
     "expandable_segments:True breaks (docs/cluster.md)"),
    (r"^VLLM_ASCEND_ENABLE_NZ$", "harmful", "the rollout turns vllm-ascend's NZ weights off itself: wake-up and the "
     "in-place weight sync refuse them (docs/accelerators.md, finding 3)"),
    (r"^VLLM_ENABLE_V1_MULTIPROCESSING$", "harmful", "the engine runs inside each rank here (vLLM sets it to 0 itself)"),
    (r"^(MASTER_ADDR|MASTER_PORT|RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE)$", "harmful", "torchrun sets each "
     "rank's own"),
    (r"^LD_PRELOAD$", "harmful", "vLLM's CPU and Ascend platforms set their own; a library preloaded into every rank "
     "and its subprocesses changes what the trainer runs with"),
    (r"^(RAY_|HYDRA_)", "not needed", "no Ray and no Hydra here"),
    (r"^(VERL_|USE_OPTIMIZED_MODEL$)", "not needed", "verl's own switches"),
    (r"^VLLM_USE_V1$", "not needed", "vLLM 0.32 has only its V1 engine"),
    (r"^(CUDA_DEVICE_MAX_CONNECTIONS|NVTE_)", "not needed", "Megatron / TransformerEngine settings: no Megatron here"),
    (r"^(HTTPS?_PROXY|NO_PROXY)$", "not needed", "nothing is downloaded at run time here"),
    (r"^(CKPT_DIR|PYTHONPATH)$", "not needed", "paths for verl's own modules and checkpoints: the config holds them here"),
    (r"^(HCCL_|ASCEND_|TASK_QUEUE_ENABLE$|CPU_AFFINITY_CONF$|MULTI_STREAM_MEMORY_REUSE$|COMBINED_ENABLE$|"
     r"DISABLE_L2_CACHE$)", "kept", "Ascend runtime settings: torch_npu and HCCL read them here too"),
    (r"^VLLM_ASCEND_", "kept", "vllm-ascend's kernel switches: the rollout's engine reads them"),
    (r"^(NCCL_|GLOO_|TORCH_NCCL_|CUDA_VISIBLE_DEVICES$|OMP_NUM_THREADS$|TOKENIZERS_PARALLELISM$|PYTHONUNBUFFERED$)",
     "kept", "read by torch.distributed, CUDA or the tokenizer here as in verl"),
    (r"^(VLLM_|WANDB_|HF_|TRANSFORMERS_)", "kept", "read by vLLM, wandb or Hugging Face here as in verl"),
)


def classify_env(exports: dict[str, str]) -> list[tuple[str, str, str, str]]:
    """(name, value, class, reason) for each exported variable: kept / not needed / harmful."""
    out = []
    for name, value in exports.items():
        kind, why = "kept", "not known to matter here; kept as the script set it"
        for pattern, k, reason in ENV_RULES:
            if re.search(pattern, name):
                kind, why = k, reason
                break
        if kind == "alloc":
            kind = "harmful" if "expandable_segments:true" in value.replace(" ", "").lower() else "kept"
            why = why if kind == "harmful" else "allocator settings other than expandable segments"
        out.append((name, value, kind, why))
    return out


def infer_device(requested: str | None, values: dict, exports: dict[str, str], shell_device: str) -> tuple[str, str]:
    """(cuda | npu, why): --device, trainer.device, the script's Ascend exports, its DEVICE variable."""
    if requested:
        return requested, "--device"
    if str(values.get("trainer.device", ("",))[0]) == "npu":
        return "npu", "trainer.device=npu"
    markers = sorted(n for n in exports if ASCEND_MARKERS.match(n))
    if markers:
        return "npu", f"the script exports {', '.join(markers[:3])}{'...' if len(markers) > 3 else ''}"
    if shell_device == "npu":
        return "npu", "the script's DEVICE is npu"
    return "cuda", "no Ascend marker in the script"


def venv_bin() -> str:
    """The repository's .venv/bin, else the folder of the interpreter running the converter."""
    own = os.path.join(REPO, ".venv", "bin")
    return own if os.path.isdir(own) else os.path.dirname(sys.executable)


def launch_lines(out: str, device: str, gpus: int, nodes: int, env: list[tuple[str, str, str, str]],
                 trackers: list[str]) -> list[str]:
    """What to run, printed after a conversion: every path absolute."""
    config, q = os.path.abspath(out), shlex.quote
    kept = " ".join(f"{n}={q(v)}" for n, v, kind, _ in env if kind == "kept")
    prefix = kept + " " if kept else ""
    binary = venv_bin()
    lines = []
    if nodes == 1:
        lines.append(f"{prefix}{q(os.path.join(binary, 'torchrun'))} --standalone --nproc_per_node={gpus} "
                     f"{q(os.path.join(REPO, 'train_grpo.py'))} --config {q(config)}")
    if nodes > 1 or device == "npu":
        gpu_flag = "" if device == "npu" else f" --gpus-per-node={gpus}"
        npu_env = f"DEVICE=npu NPROC_PER_NODE={gpus} " if device == "npu" else ""
        lines.append(f"{'or on Slurm: ' if nodes == 1 else ''}cd {q(REPO)} && mkdir -p logs && {prefix}{npu_env}sbatch "
                     f"--nodes={nodes}{gpu_flag} scripts/slurm/train_grpo.sbatch {q(config)}"
                     + ("   # add --gres=npu:N where the cluster defines an npu GRES" if device == "npu" else "")
                     + "   # docs/cluster.md: IFNAME, a shared output_dir")
    lines.append(f"dry run first: {q(os.path.join(binary, 'python'))} {q(os.path.join(REPO, 'scripts', 'check_config.py'))}"
                 f" --config {q(config)} --device {device} --nproc {gpus} --nnodes {nodes}")
    if "wandb" in trackers:
        lines.append("WANDB_MODE: wandb is offline here unless logging.wandb.mode or WANDB_MODE=online says otherwise "
                     "(upload later with `wandb sync`)")
    for name, value, kind, why in env:
        if kind != "kept":
            lines.append(f"the script exported {name}={value}: {kind} here ({why}); left off the launch line")
    if any(kind == "kept" for _, _, kind, _ in env):
        lines.append("kept on the launch line: " + "; ".join(f"{n} ({why})" for n, _, k, why in env if k == "kept"))
    return lines
