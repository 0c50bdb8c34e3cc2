"""Which VeOmni kernels the policy runs on each device, as VeOmni's own ``OpsImplementationConfig``.

VeOmni 0.1.12 validates every name against the device when that object is constructed
(veomni/arguments/arguments_types.py:1276-1278 -> ``_validate_implementations`` :1331-1372): on
Ascend only the names of ``_NPU_ALLOWED`` (:1028-1036) or ``eager`` pass. The choice per device
(``fused_kernels``):

* cuda: liger-kernel's Triton RMSNorm, SwiGLU MLP and RoPE (VeOmni's GPU defaults, :1141-1161) when
  VeOmni finds liger-kernel (requirements-cuda.txt installs it; VeOmni's own probe
  ``is_liger_kernel_available``), else eager;
* npu: VeOmni's torch_npu RMSNorm and RoPE, text and vision (its NPU fallbacks,
  ``_NPU_DEFAULT_FALLBACK`` :1046-1054); SwiGLU has no NPU kernel and stays eager;
* cpu: eager everywhere (the fused kernels are Triton or torch_npu).

Cross-entropy is not chosen: the trainer always asks the model for log-probs
(``return_log_probs=True``), which every cross-entropy implementation routes to VeOmni's chunked
log-prob kernel instead of its loss (ops/kernels/cross_entropy/__init__.py:107-160 for the eager and
liger wrappers, :388-440 for chunk_loss / npu). The MoE load-balancing loss is not used either.
"""

from __future__ import annotations

import contextlib

from rlcore.engine import moe as engine_moe

EAGER = dict(
    cross_entropy_loss_implementation="eager",
    rms_norm_implementation="eager",
    swiglu_mlp_implementation="eager",
    rotary_pos_emb_implementation="eager",
    rotary_pos_emb_vision_implementation="eager",  # Qwen-VL ViT
    load_balancing_loss_implementation="eager",
    rms_norm_gated_implementation="eager",
    causal_conv1d_implementation="eager",
    chunk_gated_delta_rule_implementation="eager",
)
SHOWN = {"rms_norm_implementation": "rms_norm", "swiglu_mlp_implementation": "swiglu",
         "rotary_pos_emb_implementation": "rope", "rotary_pos_emb_vision_implementation": "vision rope"}


def fused_kernels(device_type: str) -> dict[str, str]:
    """The ``OpsImplementationConfig`` fields this device runs fused (see the module docstring)."""
    from veomni.utils import import_utils

    if device_type == "cuda" and import_utils.is_liger_kernel_available():
        return {"rms_norm_implementation": "liger_kernel", "swiglu_mlp_implementation": "liger_kernel",
                "rotary_pos_emb_implementation": "liger_kernel"}
    if device_type == "npu":
        return {"rms_norm_implementation": "npu", "rotary_pos_emb_implementation": "npu",
                "rotary_pos_emb_vision_implementation": "npu"}
    return {}


def kernel_fields(device_type: str, overrides: dict | None = None) -> dict[str, str]:
    """Every kernel field but attention and experts: eager, the device's fused ones, then ``overrides``."""
    return {**EAGER, **fused_kernels(device_type), **(overrides or {})}


def ops_config(attn_implementation: str, moe_implementation: str, experts: int, device_type: str,
               overrides: dict | None = None):
    """VeOmni's ``OpsImplementationConfig`` for the policy (constructing it runs VeOmni's device
    validation). ``moe_implementation``: the project's name (``engine_moe.pick_moe_implementation``),
    mapped to VeOmni's (``engine_moe.veomni_moe_implementation``); ``experts``: 0 for a dense model."""
    from veomni.arguments.arguments_types import OpsImplementationConfig

    return OpsImplementationConfig(
        attn_implementation=attn_implementation,
        moe_implementation=engine_moe.veomni_moe_implementation(moe_implementation, experts),
        **kernel_fields(device_type, overrides))


def describe_kernels(fields: dict[str, str]) -> str:
    """``kernels: rms_norm liger_kernel, swiglu liger_kernel, ...`` for the start-up line."""
    return "kernels: " + ", ".join(f"{short} {fields[name]}" for name, short in SHOWN.items())


@contextlib.contextmanager
def veomni_sees(device: str):
    """VeOmni's device probe answering for ``device`` (its validation asks it at construction)."""
    import veomni.utils.import_utils as import_utils

    saved = import_utils.is_torch_npu_available
    import_utils.is_torch_npu_available = lambda: device == "npu"
    try:
        yield
    finally:
        import_utils.is_torch_npu_available = saved
