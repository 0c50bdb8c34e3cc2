"""Every keyword the policy's (and a judge's) engine hands ``vllm.LLM``, decided without building
anything: ``ColocateRollout`` builds with them and scripts/check_config.py's dry run hands them to
vLLM's ``EngineArgs.create_engine_config``. The pure per-platform choices behind them are in
``rlcore.rollout.checks``."""

from __future__ import annotations

import os

from rlcore.rollout import lora as rollout_lora
from rlcore.rollout.checks import cpu_prefill_kwargs, disable_npu_nz, multimodal_kwargs, pick_block_size, speed_kwargs

# Sampled-token logprob = log_softmax(logits / T) after top-k/top-p: what the trainer recomputes.
# vLLM's default ("raw_logprobs") ignores the temperature.
LOGPROBS_MODE = "processed_logprobs"


def llm_kwargs(model_path: str, device_type: str, *, tp_size: int, seed: int, max_model_len: int, dtype: str,
               kv_cache_gb: float, gpu_memory_utilization: float, enforce_eager: bool, multimodal: bool,
               speed: dict, limit_mm_per_prompt: dict | None = None, mm_processor_cache_gb: float | None = None,
               routed_experts: bool = False, lora_rank: int = 0, runner: str = "generate",
               sleep_mode: bool = True) -> dict:
    """Every keyword ``ColocateRollout`` hands ``vllm.LLM(...)`` (and so vLLM's ``EngineArgs``),
    without building anything: the engine and scripts/check_config.py's dry run use this one.
    ``seed``: the engine seed plus the DP rank (same inside a TP group: ranks must sample the same
    token; different per replica, else every replica samples identical completions). On CPU it
    drops ``VLLM_CPU_KVCACHE_SPACE`` from the environment and on npu it sets vllm-ascend's NZ
    switch (both read while the engine is built). ``routed_experts``: vLLM returns each sample's
    experts per token (R3 routing replay; rlcore.rollout.routing). ``lora_rank``: LoRA for
    the policy's adapter (rlcore.rollout.lora). ``runner``, ``sleep_mode``: a judge's engine
    (pooling for reward models; no vLLM sleep mode for a second engine: rlcore.rollout.offload).
    ``speed["block_size"]`` None is 32 on CPU (rollout.checks.pick_block_size)."""
    if device_type == "cpu":
        # Explicit size: vLLM's auto sizing takes ~60% of host RAM per rank (OOM with 2 ranks).
        # The legacy env var would silently override it (restored by ProcessState).
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        memory = {"kv_cache_memory_bytes": int(kv_cache_gb * 2**30)}
    else:  # release_memory() -> llm.sleep(level) or release_kv_cache_memory(): the sleep-mode allocator
        memory = {"gpu_memory_utilization": gpu_memory_utilization, "enable_sleep_mode": sleep_mode}
    return dict(
        model=model_path, tensor_parallel_size=tp_size, distributed_executor_backend="external_launcher",
        seed=seed, logprobs_mode=LOGPROBS_MODE, use_tqdm_on_load=False,
        max_model_len=max_model_len, dtype=dtype, enforce_eager=enforce_eager, **memory,
        **speed_kwargs(**{**speed, "block_size": pick_block_size(device_type, speed.get("block_size"),
                                                                 speed.get("enable_prefix_caching"))}),
        **disable_npu_nz(device_type),  # before the build: vllm-ascend reads its NZ setting then
        **cpu_prefill_kwargs(device_type),
        **multimodal_kwargs(multimodal, limit_mm_per_prompt=limit_mm_per_prompt,
                            mm_processor_cache_gb=mm_processor_cache_gb),
        **({"enable_return_routed_experts": True} if routed_experts else {}),
        **rollout_lora.engine_kwargs(lora_rank),
        **({"runner": runner} if runner != "generate" else {}),
    )


def config_llm_kwargs(cfg, device_type: str) -> dict:
    """``llm_kwargs`` of a run's config (``rlcore.config.Config``) for ``device_type``."""
    r, m = cfg.rollout, cfg.model
    return llm_kwargs(m.path, device_type, tp_size=r.tensor_parallel_size, seed=cfg.trainer.seed,
                      max_model_len=r.max_model_len, dtype=r.dtype or m.dtype, kv_cache_gb=r.kv_cache_gb,
                      gpu_memory_utilization=r.gpu_memory_utilization, enforce_eager=r.enforce_eager,
                      multimodal=bool(cfg.data.image_key), limit_mm_per_prompt=r.limit_mm_per_prompt,
                      speed=dict(max_num_seqs=r.max_num_seqs, max_num_batched_tokens=r.max_num_batched_tokens,
                                 enable_prefix_caching=r.enable_prefix_caching, block_size=r.block_size),
                      routed_experts=cfg.algorithm.routing_replay == "r3", lora_rank=config_lora_rank(cfg))


def config_lora_rank(cfg) -> int:
    """The rank vLLM must serve: the configured one, or the starting adapter's."""
    if not cfg.lora.enabled:
        return 0
    if cfg.lora.path is None:
        return cfg.lora.rank
    from rlcore.hf_folder import adapter_rank

    return adapter_rank(cfg.lora.path)
