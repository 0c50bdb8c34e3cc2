"""Building the policy's VeOmni model: the parallel state (FSDP2 or HSDP mesh, EP mesh), the meta-
initialised model with its kernels, and FSDP2 sharding with the HF weights loaded into the shards.
An engine module (rlcore.engine_veomni is its only user)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlcore import heap
from rlcore.engine import remote_code, transformers_compat
from rlcore.hf_folder import model_num_experts
from rlcore.dist import DistInfo
from rlcore.engine import moe as engine_moe, vl as engine_vl
from rlcore.engine.kernels import ops_config


def install_cpu_shims() -> None:
    """torch 2.13 has no ``torch.cpu.empty_cache``; VeOmni calls it after a DCP save (through
    ``get_torch_device().empty_cache()``) and would raise on CPU. A no-op is the right meaning."""
    if not hasattr(torch.cpu, "empty_cache"):
        torch.cpu.empty_cache = lambda: None


def mesh_sizes(world_size: int, ulysses_size: int = 1, fsdp_size: int | None = None) -> dict:
    """VeOmni's data-parallel sizes for ``parallel.fsdp_size`` (the ranks that shard one copy of
    the parameters; None = every rank, plain FSDP). VeOmni lays its mesh out as (dp_replicate,
    dp_shard, ulysses) with the last dim innermost (veomni/distributed/parallel_state.py:566-575)
    and shards FSDP2 over dp_shard x ulysses (``dp_shard_sp``, :597-610), so a shard group is a
    block of ``fsdp_size`` consecutive ranks holding whole Ulysses groups, and with dp_replicate > 1
    ``fsdp_mesh`` is the 2-D (dp_replicate, dp_shard_sp) mesh: HSDP (:230-237). The caller checked
    that ulysses_size divides fsdp_size and fsdp_size divides the world (rlcore.run.preflight)."""
    fsdp = fsdp_size or world_size
    if fsdp % ulysses_size or world_size % fsdp:
        raise ValueError(f"fsdp_size {fsdp} must divide the world size {world_size} and be a multiple of "
                         f"ulysses_size {ulysses_size}")
    dp = world_size // ulysses_size  # parallel_state.py:96: dp x ulysses = world
    return {"dp_size": dp, "dp_replicate_size": world_size // fsdp, "dp_shard_size": fsdp // ulysses_size}


def ensure_parallel_state(info: DistInfo, ep_size: int = 1, ulysses_size: int = 1, fsdp_size: int | None = None):
    """One FSDP2 mesh over all ranks (or HSDP: shards over blocks of ``fsdp_size`` ranks, replicated
    across them, ``mesh_sizes``), plus the expert-parallel mesh when ``ep_size`` > 1 (see
    ``rlcore.engine.moe``) and Ulysses groups of ``ulysses_size`` consecutive ranks inside the
    data-parallel world (``rlcore.engine.ulysses``; FSDP2 shards over dp_shard x ulysses). The state
    is a process-wide VeOmni singleton, so a second engine (the frozen reference next to the actor)
    reuses it instead of building new groups."""
    from veomni.distributed import parallel_state as ps

    sizes = mesh_sizes(info.world_size, ulysses_size, fsdp_size)
    if ps.is_parallel_state_initialized():
        state = ps.get_parallel_state()
        have_ep = dist.get_world_size(state.ep_group) if state.ep_enabled else 1
        have = (state.world_size, have_ep, state.ulysses_size, state.dp_replicate_size)
        if have != (info.world_size, ep_size, ulysses_size, sizes["dp_replicate_size"]):
            raise RuntimeError(f"VeOmni parallel state has world size, ep, ulysses and dp_replicate {have}, not "
                               f"{(info.world_size, ep_size, ulysses_size, sizes['dp_replicate_size'])}")
        return state
    # The default process group must exist already (rlcore.dist.init_distributed): VeOmni's own
    # backend picker raises on CPU, so gloo has to come from us.
    assert dist.is_initialized(), "call rlcore.dist.init_distributed() before building a VeOmniPolicy"
    return ps.init_parallel_state(
        **sizes,
        ulysses_size=ulysses_size,
        dp_mode="fsdp2",
        device_type=info.device_type,
        **({"extra_parallel_sizes": (ep_size,), "extra_parallel_names": ("ep",)} if ep_size > 1 else {}),
    )


def build_sharded_model(model_path: str, info: DistInfo, *, master_dtype: str, compute_dtype: str,
                         gradient_checkpointing: bool, attn_implementation: str, ops_overrides: dict | None,
                         moe_implementation: str = "eager", wrap=None, adapter_path: str | None = None,
                         trust_remote_code: bool = False):
    """Meta-init the VeOmni model, then shard it with FSDP2 (experts over the EP mesh, when one
    exists) and load the HF weights into the shards. ``wrap``: applied to the meta model first
    (LoRA, rlcore.engine.lora; VeOmni then loads the base under PEFT names, and the adapter from
    ``adapter_path`` or freshly initialised). ``trust_remote_code``: a folder with its own modeling
    code builds from it (rlcore.engine.remote_code.register_veomni)."""
    from veomni.arguments import MixedPrecisionConfig
    from veomni.distributed.torch_parallelize import build_parallelize_model, parallelize_model_fsdp2
    from veomni.models import build_foundation_model

    heap.freeze()  # VeOmni collects after loading the weights (rlcore.heap): not over the imports
    transformers_compat.install()  # the NPU pin's transformers 5.5.4 lacks what VeOmni's VL modeling imports
    config = None
    if trust_remote_code and remote_code.auto_map(model_path):
        config = remote_code.register_veomni(model_path)
    model = build_foundation_model(
        config_path=config or model_path,
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
