"""Building the policy's VeOmni model: the parallel state (FSDP2 mesh, EP mesh), the meta-
initialised model with its kernels, and FSDP2 sharding with the HF weights loaded into the shards.
An engine module (rlcore.engine_veomni is its only user)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlcore import heap
from rlcore.hf_folder import model_num_experts
from rlcore.dist import DistInfo
from rlcore.engine import moe as engine_moe, vl as engine_vl
from rlcore.engine.kernels import ops_config


def install_cpu_shims() -> None:
    """torch 2.13 has no ``torch.cpu.empty_cache``; VeOmni calls it after a DCP save (through
    ``get_torch_device().empty_cache()``) and would raise on CPU. A no-op is the right meaning."""
    if not hasattr(torch.cpu, "empty_cache"):
        torch.cpu.empty_cache = lambda: None


def ensure_parallel_state(info: DistInfo, ep_size: int = 1, ulysses_size: int = 1):
    """One FSDP2 mesh over all ranks, plus the expert-parallel mesh when ``ep_size`` > 1 (see
    ``rlcore.engine.moe``) and Ulysses groups of ``ulysses_size`` consecutive ranks inside the
    data-parallel world (``rlcore.engine.ulysses``; FSDP2 shards over dp x ulysses: still every
    rank). The state is a process-wide VeOmni singleton, so a second engine (the frozen reference
    next to the actor) reuses it instead of building new groups."""
    from veomni.distributed import parallel_state as ps

    if ps.is_parallel_state_initialized():
        state = ps.get_parallel_state()
        have_ep = dist.get_world_size(state.ep_group) if state.ep_enabled else 1
        if (state.world_size, have_ep, state.ulysses_size) != (info.world_size, ep_size, ulysses_size):
            raise RuntimeError(f"VeOmni parallel state has world size {state.world_size}, ep {have_ep} and ulysses "
                               f"{state.ulysses_size}, not {info.world_size}, {ep_size} and {ulysses_size}")
        return state
    # The default process group must exist already (rlcore.dist.init_distributed): VeOmni's own
    # backend picker raises on CPU, so gloo has to come from us.
    assert dist.is_initialized(), "call rlcore.dist.init_distributed() before building a VeOmniPolicy"
    dp = info.world_size // ulysses_size  # veomni parallel_state.py:96: dp x ulysses = world
    return ps.init_parallel_state(
        dp_size=dp,
        dp_shard_size=dp,
        ulysses_size=ulysses_size,
        dp_mode="fsdp2",
        device_type=info.device_type,
        **({"extra_parallel_sizes": (ep_size,), "extra_parallel_names": ("ep",)} if ep_size > 1 else {}),
    )


def build_sharded_model(model_path: str, info: DistInfo, *, master_dtype: str, compute_dtype: str,
                         gradient_checkpointing: bool, attn_implementation: str, ops_overrides: dict | None,
                         moe_implementation: str = "eager", wrap=None, adapter_path: str | None = None):
    """Meta-init the VeOmni model, then shard it with FSDP2 (experts over the EP mesh, when one
    exists) and load the HF weights into the shards. ``wrap``: applied to the meta model first
    (LoRA, rlcore.engine.lora; VeOmni then loads the base under PEFT names, and the adapter from
    ``adapter_path`` or freshly initialised)."""
    from veomni.arguments import MixedPrecisionConfig
    from veomni.distributed.torch_parallelize import build_parallelize_model, parallelize_model_fsdp2
    from veomni.models import build_foundation_model

    heap.freeze()  # VeOmni collects after loading the weights (rlcore.heap): not over the imports
    model = build_foundation_model(
        config_path=model_path,
        weights_path=model_path,
        torch_dtype=master_dtype,
        init_device="meta",
        ops_implementation=ops_config(attn_implementation, moe_implementation, model_num_experts(model_path),
                                      info.device_type, ops_overrides),
    )
    engine_vl.apply_checkpoint_key_mapping(model)  # released Qwen2.5-VL names, before the weights load
    peft = {} if wrap is None else {"is_peft_model": True, "adapter_path": adapter_path}
    model = model if wrap is None else wrap(model)
    if moe_implementation == engine_moe.TORCH_EP:  # bound after the build, which binds every slot
        engine_moe.bind_experts(model, moe_implementation)
    # FSDP2 mixed precision only when compute and master dtypes differ: the all-gather then
    # casts the fp32 master shards to the compute dtype, and gradients reduce in fp32.
    mixed = compute_dtype != master_dtype
    mp = MixedPrecisionConfig(enable=mixed, param_dtype=compute_dtype, reduce_dtype="float32")
    kwargs = dict(
        weights_path=model_path,
        enable_reshard_after_forward=True,
        mixed_precision=mp,
        basic_modules=list(getattr(model, "_no_split_modules", None) or []),
        init_device="meta",
        **peft,
    )
    if info.world_size > 1:
        model = build_parallelize_model(model, enable_gradient_checkpointing=gradient_checkpointing, **kwargs)
        engine_moe.gloo_sum_reduction(model)
        return model
    # World size 1: build_parallelize_model refuses meta init ("Only FSDP training supports
    # init_device=meta": its fsdp_enabled means size > 1). The FSDP2 wrapper it would call works
    # on a one-rank mesh, so call it directly after doing the one thing it does first.
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return parallelize_model_fsdp2(model, **kwargs)
