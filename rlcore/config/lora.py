"""The ``lora`` config section (rlcore/engine/lora.py): LoRA GRPO, adapter-only training and
adapter-only weight sync. Split from rlcore.config (which re-exports it); ``__post_init__`` only
checks, and the checks against the model (``check_lora``) run before anything loads."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

from rlcore.errors import ConfigError, check
from rlcore.hf_folder import read_config

# The dense decoder's linear layers (Qwen2/2.5/3, Llama, Mistral: the families vLLM and VeOmni
# both take LoRA on); "all-linear" means these, never the LM head or the embeddings.
LINEAR_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraConfig:
    """LoRA on the policy: only adapter weights train (the optimizer holds only them, FSDP2
    still shards the frozen base), only they reach vLLM after each update (its LoRA loading, the
    base weights stay as loaded), and the KL reference is the same model with the adapter off."""

    rank: int = 0
    """LoRA rank r; 0 = off (full fine-tuning)."""
    alpha: float = 32.0
    """Scale numerator: the update is (alpha / rank) * B @ A."""
    dropout: float = 0.0
    """Dropout on the adapter's input (training forwards only)."""
    target_modules: Union[str, list[str]] = "all-linear"
    """"all-linear" (q, k, v, o, gate, up, down projections) or a list of those names."""
    path: Optional[str] = None
    """Start from this PEFT adapter folder (adapter_config.json + adapter_model.safetensors) of
    the same base model; its rank, alpha and targets replace the ones above."""

    def __post_init__(self):
        check(self.rank >= 0, "lora.rank", self.rank, "it must be >= 0 (0 = full fine-tuning), e.g. 16")
        check(self.alpha > 0, "lora.alpha", self.alpha, "it must be > 0, e.g. 2 x rank")
        check(0 <= self.dropout < 1, "lora.dropout", self.dropout, "it must be in [0, 1)")
        if self.target_modules != "all-linear":
            names = [self.target_modules] if isinstance(self.target_modules, str) else list(self.target_modules)
            unknown = [n for n in names if n not in LINEAR_TARGETS]
            check(not unknown and names, "lora.target_modules", self.target_modules,
                  f"use \"all-linear\" or a list of {', '.join(LINEAR_TARGETS)}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0 or self.path is not None

    def targets(self) -> list[str]:
        if self.target_modules == "all-linear":
            return list(LINEAR_TARGETS)
        return [self.target_modules] if isinstance(self.target_modules, str) else list(self.target_modules)


def _layer_dims(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target layer from a dense model's config.json."""
    h, i = config["hidden_size"], config.get("intermediate_size", 4 * config["hidden_size"])
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    d = config.get("head_dim") or h // heads
    return {"q_proj": (h, heads * d), "k_proj": (h, kv * d), "v_proj": (h, kv * d), "o_proj": (heads * d, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def check_lora(lora: LoraConfig, model_path: str, experts: int, vision: bool) -> None:
    """Before loading: what this build supports, a rank each target layer can hold, and an
    adapter folder that is one and fits this base model."""
    if not lora.enabled:
        return
    if experts:
        # vllm 0.32 serves LoRA on fused-MoE layers only through its Triton MoE kernel (fused_moe/oracle/
        # unquantized.py:234-248 picks TRITON once LoRA is on; its CPU punica wrapper has no expert ops,
        # lora/punica_wrapper/punica_base.py add_lora_w13/w2), and VeOmni saves expert adapters as [E, ...]
        # tensors where vLLM reads per-expert names (lora/utils.py:411-416): neither is wired in here.
        raise ConfigError(f"lora.rank={lora.rank} with model.path={model_path!r}, a mixture-of-experts model "
                          f"({experts} experts): LoRA on MoE policies is not supported yet (vLLM's fused-MoE LoRA "
                          f"needs its Triton kernel, and VeOmni's expert adapters are not converted to vLLM's "
                          f"per-expert names); use full fine-tuning (lora.rank: 0)")
    try:
        config = read_config(model_path)
        dims = _layer_dims(config.get("text_config", config) if vision else config)  # VL: the language model's
    except (OSError, ValueError, KeyError):
        return  # the model folder's own checks name what is wrong with it
    if lora.path is not None:
        _check_adapter(lora.path, dims, model_path)
        return
    for name in lora.targets():
        small = min(dims[name])
        check(lora.rank <= small, "lora.rank", lora.rank,
              f"it exceeds {name}'s smaller dimension {small} in {model_path}: pick a rank <= {small} (8-64 is usual)")


def _check_adapter(path: str, dims: dict[str, tuple[int, int]], model_path: str) -> None:
    from safetensors import safe_open

    cfg_file, weights = os.path.join(path, "adapter_config.json"), os.path.join(path, "adapter_model.safetensors")
    if not (os.path.isfile(cfg_file) and os.path.isfile(weights)):
        raise ConfigError(f"lora.path={path!r} is not a PEFT adapter folder: it needs adapter_config.json and "
                          f"adapter_model.safetensors (what PEFT's save_pretrained and this trainer's exports write)")
    with safe_open(weights, "pt") as f:
        for key in f.keys():
            module = key.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1]
            if module not in dims or ".lora_" not in key:
                continue
            shape = tuple(f.get_slice(key).get_shape())
            want = dims[module][0] if ".lora_A." in key else dims[module][1]
            got = shape[1] if ".lora_A." in key else shape[0]
            if got != want:
                raise ConfigError(f"lora.path={path!r} was trained on another base model: {key} has shape "
                                  f"{list(shape)}, but {module} in model.path={model_path!r} has "
                                  f"{'in' if '.lora_A.' in key else 'out'} features {want}; point lora.path at an "
                                  f"adapter of this model, or model.path at the adapter's base")
