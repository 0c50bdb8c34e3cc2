"""The builders that make the engines (``rlcore.protocols``' ``Policy`` and ``Rollout``, the
judges, the phase switch) from their own config sections. Shared by ``train_grpo.py`` and
``scripts/evaluate.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlcore import quiet
from rlcore.config import Config, ModelConfig, OffloadConfig, OptimConfig, RolloutConfig
from rlcore.dist import DistInfo
from rlcore.distill import build_teacher
from rlcore.judge import build_judges
from rlcore.metrics import Timer
from rlcore.protocols import Policy, Rollout
from rlcore.rollout.settings import config_lora_rank


@dataclass
class Engines:
    policy: Policy
    ref: Policy | None  # frozen reference for the KL loss (algorithm.kl_loss_coef > 0)
    rollout: Rollout
    switch: object  # rlcore.step.switch.PhaseSwitcher
    judges: dict = field(default_factory=dict)  # reward.models: name -> rlcore.judge.scorer.Judge
    teacher: object = None  # distill.teacher: rlcore.distill.teacher.Teacher, else None


def loss_options(cfg: Config) -> dict:
    """``grpo.train_on_batch``'s options from the config: rollout correction, Clip-Cov, distillation's
    top-k term."""
    from rlcore.algo.exploration import clip_cov_options

    return {"tis_cap": cfg.rollout_correction.tis_cap, "clip_cov": clip_cov_options(cfg.exploration),
            "correction": cfg.rollout_correction.options(), "distill": cfg.distill.loss_options()}


def build_policy(model: ModelConfig, optim: OptimConfig, info: DistInfo, total_optim_steps: int,
                 ep_size: int = 1, routing_replay: bool = False, lora=None, merge_lora: bool = False,
                 ulysses_size: int = 1, fsdp_size: int | None = None) -> Policy:
    from rlcore.engine_veomni import VeOmniPolicy

    if lora is not None and lora.enabled:
        from rlcore.engine_veomni import LoraPolicy

        return LoraPolicy(model.path, info, lora=lora, merge_export=merge_lora,
                          ulysses_size=ulysses_size, fsdp_size=fsdp_size,
                          **_policy_kwargs(model, optim, total_optim_steps, ep_size, routing_replay))
    return VeOmniPolicy(model.path, info, **_policy_kwargs(model, optim, total_optim_steps, ep_size, routing_replay),
                        ulysses_size=ulysses_size, fsdp_size=fsdp_size)


def _policy_kwargs(model: ModelConfig, optim: OptimConfig, total_optim_steps: int, ep_size: int,
                   routing_replay: bool) -> dict:
    return dict(
        dtype=model.dtype, gradient_checkpointing=model.gradient_checkpointing,
        attn_implementation=model.attn_implementation, lr=optim.lr, weight_decay=optim.weight_decay,
        betas=tuple(optim.betas), adam_eps=optim.eps, optimizer=optim.optimizer,
        optimizer_state_dtype=optim.state_dtype, kahan_summation=optim.kahan_summation, lr_schedule=optim.lr_schedule,
        warmup_steps=optim.warmup_steps, min_lr_ratio=optim.min_lr_ratio, total_steps=total_optim_steps,
        grad_clip=optim.grad_clip, ep_size=ep_size, moe_implementation=model.moe_implementation,
        **({"freeze_vision_tower": True} if model.freeze_vision_tower else {}),
        **({"routing_replay": True} if routing_replay else {}),
        **({"trust_remote_code": True} if model.trust_remote_code else {}))


def build_reference(model: ModelConfig, offload: OffloadConfig, info: DistInfo, ep_size: int = 1,
                    ulysses_size: int = 1, fsdp_size: int | None = None) -> Policy:
    from rlcore.engine_veomni import VeOmniPolicy

    return VeOmniPolicy(model.path, info, dtype=model.dtype, trainable=False,
                        attn_implementation=model.attn_implementation, offload_outside_forward=offload.ref,
                        ep_size=ep_size, moe_implementation=model.moe_implementation, ulysses_size=ulysses_size,
                        fsdp_size=fsdp_size, trust_remote_code=model.trust_remote_code)


def build_rollout(model: ModelConfig, rollout: RolloutConfig, info: DistInfo, seed: int,
                  routed_experts: bool = False, lora_rank: int = 0) -> Rollout:
    from rlcore.colocate_rollout import ColocateRollout

    r = rollout
    return ColocateRollout(
        model.path, info, tp_size=r.tensor_parallel_size, seed=seed, max_model_len=r.max_model_len,
        dtype=r.dtype or model.dtype, kv_cache_gb=r.kv_cache_gb, gpu_memory_utilization=r.gpu_memory_utilization,
        sleep_level=r.sleep_level, emulate_sleep=r.emulate_sleep, emulate_ascend_moe=r.emulate_ascend_moe,
        weight_load=r.weight_load,
        enforce_eager=r.enforce_eager,
        max_num_seqs=r.max_num_seqs, max_num_batched_tokens=r.max_num_batched_tokens,
        enable_prefix_caching=r.enable_prefix_caching, block_size=r.block_size,
        return_routed_experts=routed_experts, lora_rank=lora_rank, trust_remote_code=model.trust_remote_code,
        vllm=dict(enable_chunked_prefill=r.enable_chunked_prefill, expert_parallel=r.enable_expert_parallel,
                  engine_kwargs=r.engine_kwargs),
        **({"limit_mm_per_prompt": r.limit_mm_per_prompt} if r.limit_mm_per_prompt is not None else {}))


def build_switch(policy: Policy, rollout: Rollout, model: ModelConfig, r: RolloutConfig, offload: OffloadConfig,
                 info: DistInfo, timer: Timer, probe_prompts: list[list[int]] | None = None):
    """The phase switch; with ``probe_prompts`` (token ids, e.g. the training prompts) and
    ``rollout.check_sync`` on, it checks every sync (rlcore.step.sync_check)."""
    from rlcore.step.switch import PhaseSwitcher
    from rlcore.step.sync_check import SyncCheck, probe_sequences

    checker = None
    if probe_prompts and r.check_sync != "off":
        probe = probe_sequences(probe_prompts, skip_ids=getattr(rollout, "vision_token_ids", ()))
        looser = "bfloat16" if "bfloat16" in (model.dtype, r.dtype) else model.dtype  # the coarser engine's tolerance
        checker = SyncCheck(r.check_sync, looser, probe, info.device, tol=r.check_sync_tol,
                            is_main=info.is_main, every=r.check_sync_every)
    return PhaseSwitcher(policy, rollout, timer, info.device_type, offload_params=offload.params,
                         offload_optimizer=offload.optimizer, free_kv_cache=r.free_kv_cache,
                         rollout_dtype=r.dtype or model.dtype, sync_bucket_mb=r.sync_bucket_mb, rank=info.rank,
                         checker=checker)


def build_engines(cfg: Config, info: DistInfo, timer: Timer, probe_prompts: list[list[int]] | None = None) -> Engines:
    """The policy, the reference (when the KL loss is on), the vLLM engine, the phase switch, and
    the judges and the distillation teacher when configured, for a resolved config
    (``rlcore.config.resolve``); third-party start-up noise filtered.
    ``probe_prompts``: token ids for the sync check (``build_switch``)."""
    torch.manual_seed(cfg.trainer.seed)
    if info.device_type != "cpu":  # before anything large lands on the device
        from rlcore.plan.judges import check_judging_fits
        from rlcore.plan.memory import device_total_gb, format_plan, plan_from_config

        plan = plan_from_config(cfg, info.world_size, device_total_gb(info.device_type), info.device_type,
                                nproc_per_node=info.local_world_size)
        if info.is_main:
            print(format_plan(plan), flush=True)
        check_judging_fits(plan)  # every rank: exit 2 when the judges cannot fit
    with quiet.filtered_output():
        ep = cfg.parallel.ep_size
        optim_steps = cfg.trainer.total_steps * cfg.algorithm.optim_steps_per_step
        policy = build_policy(cfg.model, cfg.optim, info, optim_steps, ep, cfg.algorithm.routing_replay is not None,
                              cfg.lora, cfg.checkpoint.merge_lora, cfg.parallel.ulysses_size, cfg.parallel.fsdp_size)
        ref = None
        if cfg.algorithm.kl_loss_coef > 0:  # LoRA: the policy with its adapter off, no second model
            from rlcore.engine_veomni import AdapterOffReference

            ref = (AdapterOffReference(policy) if cfg.lora.enabled
                   else build_reference(cfg.model, cfg.offload, info, ep, cfg.parallel.ulysses_size,
                                        cfg.parallel.fsdp_size))
        if cfg.offload.params or cfg.offload.optimizer:
            # The run starts in the generation phase: the trainer's state waits on the host, so
            # vLLM sizes its KV cache from the memory generation really has.
            policy.offload(params=cfg.offload.params, optimizer=cfg.offload.optimizer)
        rollout = build_rollout(cfg.model, cfg.rollout, info, cfg.trainer.seed,
                                routed_experts=cfg.algorithm.routing_replay == "r3", lora_rank=config_lora_rank(cfg))
        judges = build_judges(cfg, info, rollout)  # after the policy's engine: they share its vLLM groups
    switch = build_switch(policy, rollout, cfg.model, cfg.rollout, cfg.offload, info, timer, probe_prompts)
    with quiet.filtered_output():
        teacher = build_teacher(cfg, info, rollout, switch, timer)  # after the judges, like them
    if cfg.logging.switch_trace:
        switch.trace_to_stderr()
    return Engines(policy, ref, rollout, switch, judges, teacher)
