"""Every keyword the policy's (and a judge's) engine hands ``vllm.LLM``, and the per-device choices
behind them (``pick_*``: sleep level, weight load, eager mode, block size), decided without building
anything: ``ColocateRollout`` builds with them and scripts/check_config.py's dry run hands them to
vLLM's ``EngineArgs.create_engine_config``. The checks against a built engine are in
``rlcore.rollout.checks``."""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

from rlcore.rollout import engine_keys, lora as rollout_lora

log = logging.getLogger("rlcore.rollout")

# vllm-ascend: 0 = no FRACTAL_NZ weight format (1, the default, = quantized weights only; 2 = all).
NZ_ENV = "VLLM_ASCEND_ENABLE_NZ"
# vllm-ascend: fused MC2 (dispatch_ffn_combine) casts the experts to NZ whatever NZ_ENV says.
FUSED_MC2_ENV = "VLLM_ASCEND_ENABLE_FUSED_MC2"


# ----------------------------------------------------------------------------- engine settings


def pick_sleep_level(device_type: str, sleep_level: int | None, emulate: bool = False) -> int:
    """vLLM sleep level used by release_memory on accelerators (0: free the KV cache only,
    1: also move the weights to host memory, 2: also discard the weights); 0 on CPU unless
    ``emulate`` (rollout.emulate_sleep: the CPU engine sleeps as a device's does, rlcore.rollout.cpu_sleep).

    None picks 2: the phase switch pushes every weight before each generation anyway, so the
    host copy that level 1 keeps (and copies back at wake-up) would be wasted work and memory.
    """
    if sleep_level is not None and sleep_level not in (0, 1, 2):
        raise ValueError(f"sleep_level must be 0 (KV cache only), 1 or 2 (or None = auto), got {sleep_level}")
    if emulate and device_type != "cpu":
        raise ValueError(f"emulate_sleep is for CPU engines; on {device_type} vLLM's sleep mode is real")
    if device_type == "cpu" and not emulate:
        return 0  # sleep mode is rejected on CPU and llm.sleep() there makes generate() hang
    return 2 if sleep_level is None else sleep_level


def pick_weight_load(device_type: str, weight_load: str, moe: bool = False) -> str:
    """How update_weights loads: "reload" (vLLM's reload_weights: layer-wise restore, load,
    post-process, copy back) or "direct" (``model.load_weights`` straight into vLLM's parameters).

    auto: reload on CPU, where fp32 linear weights are repacked into oneDNN handles after loading
    (vllm 0.32.0 vllm/model_executor/layers/linear.py:206 UnquantizedLinearMethod
    .process_weights_after_loading -> dispatch_cpu_unquantized_gemm). direct on CUDA and NPU:
    unquantized dense layers need no post-load processing there once vllm-ascend's FRACTAL_NZ cast
    is off (vllm-ascend 0.23.0 vllm_ascend/ops/linear.py:86-98, maybe_trans_nz is a no-op with
    weight_nz_mode=0, utils.py:261-298), and vllm-ascend 0.23.0's NPUWorker has no reload_weights
    (vllm_ascend/worker/worker.py:89-1037; 0.26.0rc1 adds it at worker.py:1115): reload goes through
    its model runner there (see reload_weights_method). A mixture-of-experts model (``moe``)
    reloads on every device: vLLM's fused-MoE layers post-process (CPU: pre-pack, see
    cpu_repack.cpu_repack_on_reload) the expert weights after loading, and Ascend refuses a direct MoE load.
    """
    if weight_load not in ("auto", "reload", "direct"):
        raise ValueError(f"weight_load must be auto, reload or direct, got {weight_load!r}")
    if weight_load == "direct" and device_type == "cpu":
        raise ValueError("weight_load=direct does not work on CPU (vLLM repacks linear weights); use reload")
    if weight_load == "direct" and moe:
        # vllm 0.32.0 fused_moe/oracle/unquantized.py: the FlashInfer TRTLLM / CUTLASS backends
        # shuffle the expert tensors and swap w13 into w31 after loading, so a direct load writes
        # checkpoint-layout tensors into kernel-layout storage (same shapes, wrong experts); the CPU
        # kernel pre-packs them (cpu_repack.py). No backend is known to need no post-load step.
        raise ValueError("weight_load=direct is not supported for mixture-of-experts models: vLLM post-processes "
                         "the expert weights after loading (layout shuffles, w13/w31 swaps, pre-packing), which a "
                         "direct load skips; use reload (or auto)")
    if weight_load == "auto":
        return "reload" if device_type == "cpu" or moe else "direct"
    return weight_load


def pick_enforce_eager(device_type: str, enforce_eager: bool | None) -> bool:
    """None: eager on CPU (no CUDA graphs there; it also skips the inductor compile of the
    sampler helpers, 10-15 s per process), graphs on CUDA and NPU.

    Graphs survive sleep/wake because weights and KV cache come back at the same device
    addresses: the handle kept per allocation holds its virtual address and wake-up maps new
    physical memory there (vllm 0.32.0 vllm/device_allocator/__init__.py:13-14 HandleType,
    cumem.py:277-278 unmap in sleep, :346-350 create_and_map in wake_up; vllm-ascend 0.26.0rc1
    vllm_ascend/device_allocator/camem.py:74-75, :217, :240). The graph pool itself is outside
    the weights/kv_cache pools and stays resident (vllm 0.32.0 sleep_mode_backend.py:131-136,
    model.py:380 sleep_mode_offload_cudagraph=False). Weight pushes write into the existing
    parameter storage (direct: weight_loader copy_; reload: vllm 0.32.0
    model_loader/reload/layerwise.py:417 _copy_and_restore_kernel_tensors), so captured
    pointers stay valid.
    """
    return device_type == "cpu" if enforce_eager is None else bool(enforce_eager)


CPU_BLOCK_SIZE = 32


def pick_block_size(device_type: str, block_size: int | None, enable_prefix_caching: bool | None = None) -> int | None:
    """Tokens per KV-cache block; None leaves vLLM's default.

    On CPU the default is 32, not vLLM's 128 (vllm 0.32.0 platforms/cpu.py:292-293): prefix caching
    shares only full blocks, so with 128-token blocks no prompt shorter than 128 tokens is shared
    and each of a prompt's n samples recomputes it. The CPU attention kernels take any multiple of
    32 (v1/attention/backends/cpu_attn.py:65-66). Measured on SmolLM2-135M, 16 word problems of
    50-66 tokens x 8 samples x 24 tokens, 2 cores: 13.7 s a generate with 128-token blocks, 7.5 s
    with 32 (12.7 s with 32 and prefix caching off). Accelerators keep vLLM's default."""
    if block_size is not None:
        if block_size < 1 or (device_type == "cpu" and block_size % CPU_BLOCK_SIZE):
            raise ValueError(f"block_size={block_size}: vLLM's CPU attention needs a multiple of {CPU_BLOCK_SIZE} "
                             f"(v1/attention/backends/cpu_attn.py:65), e.g. 32, or null for {CPU_BLOCK_SIZE}"
                             if device_type == "cpu" else f"block_size={block_size} must be > 0, or null")
        return block_size
    return CPU_BLOCK_SIZE if device_type == "cpu" and enable_prefix_caching is not False else None


def speed_kwargs(*, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 enable_prefix_caching: bool | None = None, block_size: int | None = None) -> dict:
    """The scheduler/cache settings that were set (None = leave vLLM's own default in place)."""
    given = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                 enable_prefix_caching=enable_prefix_caching, block_size=block_size)
    return {k: v for k, v in given.items() if v is not None}


def is_multimodal_config(config: dict) -> bool:
    """Whether an HF ``config.json`` (as a dict) describes a model that takes images (or audio):
    Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE) and the other vision-language configs of transformers nest
    a ``vision_config``; audio-language ones an ``audio_config``. Read before the engine exists, to
    pick the multimodal engine settings (multimodal_kwargs); the built engine's own answer is
    ``ModelConfig.is_multimodal_model`` (vllm 0.32.0 config/model.py:1980-1982)."""
    return isinstance(config.get("vision_config"), dict) or isinstance(config.get("audio_config"), dict)


def multimodal_kwargs(multimodal: bool, *, limit_mm_per_prompt: dict[str, int] | None = None,
                      mm_processor_cache_gb: float | None = None) -> dict:
    """The ``LLM(...)`` keywords for images in prompts; {} for a text model unless asked for.

    ``limit_mm_per_prompt`` ({"image": 2, "video": 0}): set only when given (vLLM's default is
    999 items of each modality, vllm 0.32.0 config/multimodal.py:307-325). vLLM refuses a prompt
    with more items, and on accelerators sizes the encoder's profiling run by it; a 0 keeps that
    modality out (no dummy videos profiled).

    ``mm_processor_cache_gb``: None gives 0 on a multimodal model. vLLM's default, 4 GiB
    (config/multimodal.py:357), is an LRU of the processed items, pixel tensors included, in host
    memory: with the in-process engine (one API process, vLLM DP 1) the cache type is "lru"
    (multimodal/cache/factories.py:23-46), whose engine-side half keeps every new item's
    ``MultiModalKwargsItem`` until 4 GiB are full (multimodal/cache/lru.py:86-122, sized at
    :99-107). A GRPO step brings new images every time (the n samples of a prompt are one request,
    processed once), so the cache would only grow to its cap on every rank, beside the trainer,
    and hit again at best once an epoch. With 0 nothing is cached (factories.py:31-33) and each image is processed
    in its request (multimodal/processing/processor.py:1511-1512 -> _apply_hf_processor), which
    still hashes it (processor.py:1480-1482): the prefix cache and the encoder cache keep telling
    images apart.
    """
    kwargs: dict = {}
    if limit_mm_per_prompt is not None:
        bad = {k: v for k, v in limit_mm_per_prompt.items()
               if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int) or v < 0}
        if bad:
            raise ValueError(f"limit_mm_per_prompt must map a modality name to a count >= 0, got {bad}")
        kwargs["limit_mm_per_prompt"] = dict(limit_mm_per_prompt)
    if mm_processor_cache_gb is not None:
        if mm_processor_cache_gb < 0:
            raise ValueError(f"mm_processor_cache_gb must be >= 0, got {mm_processor_cache_gb}")
        kwargs["mm_processor_cache_gb"] = float(mm_processor_cache_gb)
    elif multimodal:
        kwargs["mm_processor_cache_gb"] = 0.0
    return kwargs


def disable_npu_nz(device_type: str, environ: MutableMapping[str, str] | None = None) -> dict:
    """On NPU turn vllm-ascend's FRACTAL_NZ weight format off before the engine builds; returns
    the extra ``LLM(...)`` kwargs that say the same. Other devices: nothing is touched.

    ``NPUWorker.wake_up`` raises ValueError while ``weight_nz_mode`` is non-zero, and the default
    is 1 (vllm-ascend 0.23.0 vllm_ascend/worker/worker.py:241-247, envs.py:92,
    ascend_config.py:247-254; 0.26.0rc1 worker.py:247-253, envs.py:88). NZ also re-lays out
    weights after loading, which in-place pushes would not repeat. Fused MC2 casts the experts to NZ
    whatever ``weight_nz_mode`` says, and with dynamic EPLB deletes them (0.23.0 ops/fused_moe/
    fused_moe.py:127-135; its switch: additional_config ``enable_fused_mc2``, else the env var,
    ascend_config.py:173-178): off too.
    The config key wins over the env var (0.23.0 ascend_config.py:354-365), so both are set. The env
    vars are NOT restored: vllm-ascend reads them lazily on every access (0.23.0 envs.py:118 __getattr__),
    e.g. worker.py:295-301 _check_nz_disabled, so they must stay 0 while the engine lives.
    """
    if device_type != "npu":
        return {}
    environ = os.environ if environ is None else environ
    for name, why in ((NZ_ENV, "vllm-ascend's NPUWorker.wake_up refuses NZ weights"),
                      (FUSED_MC2_ENV, "fused MC2 casts the experts to NZ, which the weight sync cannot write")):
        previous = environ.get(name)
        if previous not in (None, "0"):
            log.warning("%s=%s overridden to 0: %s", name, previous, why)
        environ[name] = "0"
    return {"additional_config": {"weight_nz_mode": 0, "enable_fused_mc2": 0}}


# Sampled-token logprob = log_softmax(logits / T) after top-k/top-p: what the trainer recomputes.
# vLLM's default ("raw_logprobs") ignores the temperature.
LOGPROBS_MODE = "processed_logprobs"


def llm_kwargs(model_path: str, device_type: str, *, tp_size: int, seed: int, max_model_len: int, dtype: str,
               kv_cache_gb: float, gpu_memory_utilization: float, enforce_eager: bool, multimodal: bool,
               speed: dict, limit_mm_per_prompt: dict | None = None, mm_processor_cache_gb: float | None = None,
               routed_experts: bool = False, lora_rank: int = 0, runner: str = "generate",
               sleep_mode: bool = True, trust_remote_code: bool = False, enable_chunked_prefill: bool | None = None,
               expert_parallel: bool = False, engine_kwargs: dict | None = None) -> dict:
    """Every keyword ``ColocateRollout`` hands ``vllm.LLM(...)`` (and so vLLM's ``EngineArgs``),
    without building anything: the engine and scripts/check_config.py's dry run use this one.
    ``seed``: the engine seed plus the DP rank (same inside a TP group: ranks must sample the same
    token; different per replica, else every replica samples identical completions). On CPU it
    drops ``VLLM_CPU_KVCACHE_SPACE`` from the environment and on npu it sets vllm-ascend's NZ
    switch (both read while the engine is built). ``routed_experts``: vLLM returns each sample's
    experts per token (R3 routing replay; rlcore.rollout.routing). ``lora_rank``: LoRA for
    the policy's adapter (rlcore.rollout.lora). ``runner``, ``sleep_mode``: a judge's engine
    (pooling for reward models; no vLLM sleep mode for a second engine: rlcore.rollout.offload).
    ``speed["block_size"]`` None is 32 on CPU (rollout.settings.pick_block_size).
    ``enable_chunked_prefill``, ``expert_parallel``, ``engine_kwargs`` (merged last, owned names
    refused): rlcore.rollout.engine_keys; only the policy's engine gets them."""
    if device_type == "cpu":
        # Explicit size: vLLM's auto sizing takes ~60% of host RAM per rank (OOM with 2 ranks).
        # The legacy env var would silently override it (restored by ProcessState).
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        memory = {"kv_cache_memory_bytes": int(kv_cache_gb * 2**30)}
    else:  # release_memory() -> llm.sleep(level) or release_kv_cache_memory(): the sleep-mode allocator
        memory = {"gpu_memory_utilization": gpu_memory_utilization, "enable_sleep_mode": sleep_mode}
    return engine_keys.merged(dict(
        model=model_path, tensor_parallel_size=tp_size, distributed_executor_backend="external_launcher",
        seed=seed, logprobs_mode=LOGPROBS_MODE, use_tqdm_on_load=False,
        max_model_len=max_model_len, dtype=dtype, enforce_eager=enforce_eager, **memory,
        **speed_kwargs(**{**speed, "block_size": pick_block_size(device_type, speed.get("block_size"),
                                                                 speed.get("enable_prefix_caching"))}),
        **disable_npu_nz(device_type),  # before the build: vllm-ascend reads its NZ setting then
        **engine_keys.chunked_prefill_kwargs(device_type, enable_chunked_prefill),
        **engine_keys.expert_parallel_kwargs(expert_parallel, device_type),
        **multimodal_kwargs(multimodal, limit_mm_per_prompt=limit_mm_per_prompt,
                            mm_processor_cache_gb=mm_processor_cache_gb),
        **({"enable_return_routed_experts": True} if routed_experts else {}),
        **rollout_lora.engine_kwargs(lora_rank),
        **({"runner": runner} if runner != "generate" else {}),
        **({"trust_remote_code": True} if trust_remote_code else {}),  # model.trust_remote_code (rlcore.engine.remote_code)
    ), engine_kwargs)


def config_llm_kwargs(cfg, device_type: str) -> dict:
    """``llm_kwargs`` of a run's config (``rlcore.config.Config``) for ``device_type``."""
    r, m = cfg.rollout, cfg.model
    return llm_kwargs(m.path, device_type, tp_size=r.tensor_parallel_size, seed=cfg.trainer.seed,
                      max_model_len=r.max_model_len, dtype=r.dtype or m.dtype, kv_cache_gb=r.kv_cache_gb,
                      gpu_memory_utilization=r.gpu_memory_utilization, enforce_eager=r.enforce_eager,
                      multimodal=bool(cfg.data.image_key), limit_mm_per_prompt=r.limit_mm_per_prompt,
                      speed=dict(max_num_seqs=r.max_num_seqs, max_num_batched_tokens=r.max_num_batched_tokens,
                                 enable_prefix_caching=r.enable_prefix_caching, block_size=r.block_size),
                      routed_experts=cfg.algorithm.routing_replay == "r3", lora_rank=config_lora_rank(cfg),
                      trust_remote_code=m.trust_remote_code, enable_chunked_prefill=r.enable_chunked_prefill,
                      expert_parallel=r.enable_expert_parallel, engine_kwargs=r.engine_kwargs)


def config_lora_rank(cfg) -> int:
    """The rank vLLM must serve: the configured one, or the starting adapter's."""
    if not cfg.lora.enabled:
        return 0
    if cfg.lora.path is None:
        return cfg.lora.rank
    from rlcore.hf_folder import adapter_rank

    return adapter_rank(cfg.lora.path)
