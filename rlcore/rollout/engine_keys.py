"""The policy engine's vLLM switches that verl users set: ``rollout.enable_chunked_prefill``,
``rollout.enable_expert_parallel`` and ``rollout.engine_kwargs`` (free-form ``EngineArgs``, merged
last into the ``LLM(...)`` keywords of rlcore.rollout.settings.llm_kwargs). Judges and the
distillation teacher build their engines from their own sections and get none of these.

Nothing here imports vLLM at module level: the checks that need ``EngineArgs``' field names take
them as an argument (``check_config`` imports vLLM only when ``engine_kwargs`` is not empty).
"""

from __future__ import annotations

import difflib

from rlcore.errors import ConfigError

# EngineArgs fields the rollout sets itself (rollout.settings.llm_kwargs) or that would break the
# colocated design: each maps to the key to use instead, or to why it cannot change.
OWNED = {
    "model": "use model.path (the trainer and vLLM must load the same folder)",
    "tokenizer": "the trainer tokenizes prompts with model.path's tokenizer and hands vLLM token ids; vLLM "
                 "must read the same one",
    "tensor_parallel_size": "use rollout.tensor_parallel_size",
    "data_parallel_size": "each tensor-parallel group is its own engine; the replicas are world size / "
                          "rollout.tensor_parallel_size",
    "pipeline_parallel_size": "the in-process engine shards by tensor parallelism only (the weight sync hands "
                              "every rank the full tensors)",
    "distributed_executor_backend": "it is external_launcher: the engine lives in the trainer's torchrun "
                                    "processes and builds its groups over their ranks",
    "seed": "use trainer.seed (the engine seed is trainer.seed + the replica index, equal inside a TP group)",
    "logprobs_mode": "it is processed_logprobs: the importance ratio needs log_softmax(logits / T), what the "
                     "trainer recomputes",
    "use_tqdm_on_load": "the rollout keeps vLLM's load quiet",
    "max_model_len": "use rollout.max_model_len",
    "dtype": "use rollout.dtype",
    "enforce_eager": "use rollout.enforce_eager",
    "kv_cache_memory_bytes": "use rollout.kv_cache_gb (CPU)",
    "gpu_memory_utilization": "use rollout.gpu_memory_utilization",
    "enable_sleep_mode": "the phase switch sleeps the engine while training: use rollout.sleep_level and "
                         "rollout.free_kv_cache",
    "max_num_seqs": "use rollout.max_num_seqs",
    "max_num_batched_tokens": "use rollout.max_num_batched_tokens",
    "enable_prefix_caching": "use rollout.enable_prefix_caching",
    "block_size": "use rollout.block_size",
    "enable_chunked_prefill": "use rollout.enable_chunked_prefill",
    "enable_expert_parallel": "use rollout.enable_expert_parallel",
    "limit_mm_per_prompt": "use rollout.limit_mm_per_prompt",
    "enable_return_routed_experts": "use algorithm.routing_replay: r3",
    "enable_lora": "use lora.rank (or lora.path)",
    "max_lora_rank": "it follows lora.rank (or lora.path's adapter)",
    "max_loras": "the policy serves one adapter (lora.rank)",
    "runner": "the policy's engine generates; reward models are reward.models entries",
    "trust_remote_code": "use model.trust_remote_code",
    "quantization": "the weight sync pushes the trainer's unquantized weights into vLLM every step",
    "load_format": "the engine must load model.path's safetensors at start-up: the first rollout (and "
                   "trainer.val_before_train) samples before any weight sync, so 'dummy' would sample from random "
                   "weights",
}
# vllm-ascend's additional_config keys the rollout sets (rollout.settings.disable_npu_nz): the rest merge.
OWNED_ADDITIONAL = {
    "weight_nz_mode": "vllm-ascend's NZ weight format breaks wake-up and in-place weight pushes "
                      "(rollout.settings.disable_npu_nz); it stays 0",
    # vllm-ascend 0.23.0 ops/fused_moe/fused_moe.py:127-135, ascend_config.py:173-178
    "enable_fused_mc2": "vllm-ascend casts the experts to the NZ format whenever it is set, whatever weight_nz_mode "
                        "says (ops/fused_moe/fused_moe.py:127-130), and with dynamic EPLB deletes w13_weight/w2_weight "
                        "(:131-135): the weight sync would write into NZ storage or find no expert weight; it stays 0",
}


def check_keys(engine_kwargs) -> None:
    """rollout.engine_kwargs: a mapping of names to values, no name the rollout owns (OWNED)."""
    if not isinstance(engine_kwargs, dict) or not all(isinstance(k, str) for k in engine_kwargs):
        raise ConfigError(f"rollout.engine_kwargs={engine_kwargs!r} is invalid: it must map vLLM EngineArgs names "
                          f"to values, e.g. {{max_logprobs: 5}}")
    for key in engine_kwargs:
        if key in OWNED:
            raise ConfigError(f"rollout.engine_kwargs.{key}={engine_kwargs[key]!r} is refused: the rollout sets "
                              f"{key} itself; {OWNED[key]}")
    extra = engine_kwargs.get("additional_config")
    if extra is not None and not isinstance(extra, dict):
        raise ConfigError(f"rollout.engine_kwargs.additional_config={extra!r} is invalid: it must be a mapping "
                          f"(vllm-ascend's additional_config)")
    for key in set(extra or ()) & set(OWNED_ADDITIONAL):
        raise ConfigError(f"rollout.engine_kwargs.additional_config.{key}={extra[key]!r} is refused: "
                          f"{OWNED_ADDITIONAL[key]}")


def check_fields(engine_kwargs: dict, field_names) -> None:
    """Every rollout.engine_kwargs name is a field of this vLLM's ``EngineArgs``; a typo is named
    with the closest fields."""
    names = list(field_names)
    for key in engine_kwargs:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=3)
            hint = f"did you mean {', '.join(close)}?" if close else "see vLLM's EngineArgs for the names"
            raise ConfigError(f"rollout.engine_kwargs.{key} is invalid: this vLLM's EngineArgs has no field {key!r}; "
                              f"{hint}")


def merged(base: dict, engine_kwargs: dict | None) -> dict:
    """``base`` (llm_kwargs' own keywords) with rollout.engine_kwargs merged last; vllm-ascend's
    ``additional_config`` is merged key by key (the rollout's weight_nz_mode kept)."""
    if not engine_kwargs:
        return base
    check_keys(engine_kwargs)
    out = {**base, **engine_kwargs}
    if "additional_config" in engine_kwargs and "additional_config" in base:
        out["additional_config"] = {**engine_kwargs["additional_config"], **base["additional_config"]}
    return out


def chunked_prefill_kwargs(device_type: str, enable: bool | None) -> dict:
    """``{"enable_chunked_prefill": ...}`` for the engine; {} leaves vLLM's default.

    CPU: None is False, True is refused. vllm 0.32.0's CPU platform itself accepts chunked prefill
    on x86 (platforms/cpu.py:516-530 turns it off only for MLA models; engine/arg_utils.py:3041-3049
    for RISC-V), but a prompt scheduled in part has its sampled token discarded and, for a seeded
    request (every request here is), the runner rewinds its generator with ``gen.set_offset(...)``
    (v1/worker/gpu_model_runner.py:3495-3502, the mask set at :2056-2060), which a CPU
    ``torch.Generator`` does not have: the step dies once a step's prompts exceed
    max_num_batched_tokens. Without chunking the scheduler waits for room instead of splitting a
    prompt (v1/core/sched/scheduler.py:1158-1167). Accelerators' generators have offsets."""
    if device_type == "cpu":
        if enable:
            raise ValueError("vLLM's CPU runner cannot chunk a seeded prompt: it rewinds the request's generator "
                             "with set_offset (vllm 0.32.0 v1/worker/gpu_model_runner.py:3499-3502), which a CPU "
                             "torch.Generator lacks; set it false or null on cpu")
        return {"enable_chunked_prefill": False}
    return {} if enable is None else {"enable_chunked_prefill": bool(enable)}


CPU_EP_REFUSAL = ("vLLM's CPU MoE kernel ignores the expert map: CPUUnquantizedExperts.apply takes expert_map (vllm "
                  "0.32.0 model_executor/layers/fused_moe/experts/cpu_moe.py:279) and calls cpu_fused_moe without it "
                  "(:303-315), which then indexes the rank's E / tp experts with global expert ids; the engine dies with "
                  "SIGSEGV (csrc/cpu/cpu_fused_moe.cpp:242, seen on the tiny Qwen3-MoE at TP 2). Expert parallelism runs "
                  "on cuda/npu only; on cpu set it false")


def expert_parallel_kwargs(enable: bool, device_type: str = "cuda") -> dict:
    """``{"enable_expert_parallel": True}`` when asked for. In vLLM the switch shards a fused-MoE
    layer's experts over the engine's TP ranks (each rank holds E / tp experts whole) instead of
    splitting every expert's intermediate dimension over them: ``use_ep = dp * pcp * tp > 1 and
    enable_expert_parallel``, then ``ep_size = tp_size``, ``ep_rank = tp_rank`` and the MoE's own
    tp_size becomes 1 (vllm 0.32.0 model_executor/layers/fused_moe/config.py:1189-1236). Attention
    and the dense layers stay tensor-parallel. Here every engine is one TP group (the replicas are
    separate engines, vLLM's data_parallel_size is 1), so EP spans the TP group. Refused on CPU
    (CPU_EP_REFUSAL): a crash, not an error, would follow."""
    if enable and device_type == "cpu":
        raise ValueError(CPU_EP_REFUSAL)
    return {"enable_expert_parallel": True} if enable else {}


def check_config(cfg, device_type: str) -> None:
    """The three keys against the model and the device, before anything loads (rlcore.config.resolve)."""
    from rlcore.hf_folder import folder_problem, model_num_experts

    r = cfg.rollout
    try:
        chunked_prefill_kwargs(device_type, r.enable_chunked_prefill)
    except ValueError as e:
        raise ConfigError(f"rollout.enable_chunked_prefill={r.enable_chunked_prefill!r} is invalid: {e}") from e
    chunked = chunked_prefill_kwargs(device_type, r.enable_chunked_prefill).get("enable_chunked_prefill", True)
    if r.max_num_batched_tokens is not None and r.max_num_batched_tokens < r.max_model_len and not chunked:
        raise ConfigError(f"rollout.max_num_batched_tokens={r.max_num_batched_tokens} is invalid: without chunked "
                          f"prefill (rollout.enable_chunked_prefill={r.enable_chunked_prefill!r} on {device_type}) a "
                          f"prompt prefills in one scheduler step, so the budget must be >= rollout.max_model_len="
                          f"{r.max_model_len}; raise it, or leave it null for vLLM's default")
    if r.enable_expert_parallel:
        if device_type == "cpu":
            raise ConfigError(f"rollout.enable_expert_parallel=true is invalid on cpu: {CPU_EP_REFUSAL}")
        problem = folder_problem(cfg.model.path)
        if problem:  # unreadable is not dense: say what is missing
            raise ConfigError(f"rollout.enable_expert_parallel=true needs the model's experts from model.path="
                              f"{cfg.model.path!r}: {problem}")
        experts = model_num_experts(cfg.model.path)
        if experts == 0:
            raise ConfigError("rollout.enable_expert_parallel=true is invalid: the model at model.path has no experts "
                              "(a dense model); vLLM's expert parallelism shards the routed experts of MoE layers. "
                              "Set it false")
        if r.tensor_parallel_size == 1:
            raise ConfigError("rollout.enable_expert_parallel=true is invalid with rollout.tensor_parallel_size=1: each "
                              "engine here is one tensor-parallel group (replicas are separate engines), so vLLM's "
                              "EP shards the experts over the TP ranks and one rank already holds them all. Raise "
                              "rollout.tensor_parallel_size or set it false")
    check_keys(r.engine_kwargs)
    if r.engine_kwargs:
        import dataclasses

        from vllm.engine.arg_utils import EngineArgs

        check_fields(r.engine_kwargs, (f.name for f in dataclasses.fields(EngineArgs)))
