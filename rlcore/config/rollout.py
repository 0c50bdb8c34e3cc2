"""The ``rollout`` config section (the colocated vLLM engine, rlcore/colocate_rollout.py) and its
``partial`` sub-section. Split from rlcore.config.sections (rlcore.config re-exports both);
``__post_init__`` only checks, as everywhere in rlcore.config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from rlcore.agent.config import AgentConfig, MultiTurnConfig
from rlcore.errors import check, check_positive
from rlcore.rollout.engine_keys import check_keys as check_engine_kwargs_keys


@dataclass
class PartialConfig:
    """Partial rollouts (rlcore/step/partial.py): a step generates in chunks and stops once every rank
    has enough finished groups; the unfinished ones are suspended and continue in the next step."""

    enable: bool = False
    chunk_tokens: int = 64
    """Tokens per sequence per generate call; after each call one all-reduce decides whether to stop."""
    oversample: float = 1.5
    """Groups in flight per rank / groups trained per step: 1 waits for every group (synchronous, in
    chunks); above 1 the slowest groups are suspended instead of waited for."""
    max_staleness: int = 2
    """A suspended group whose oldest token would be trained more than this many policy versions after
    it was sampled is dropped (rollout/dropped_stale). Its tokens keep vLLM's log-probs of when they
    were sampled: rollout_correction corrects them (e.g. is_level: token)."""

    def __post_init__(self):
        check(self.chunk_tokens > 0, "rollout.partial.chunk_tokens", self.chunk_tokens, "it must be > 0, e.g. 64")
        check(self.oversample >= 1, "rollout.partial.oversample", self.oversample,
              "it must be >= 1 (1: wait for every group; 1.5: half as many groups again in flight)")
        check(self.max_staleness >= 0, "rollout.partial.max_staleness", self.max_staleness, "it must be >= 0")


@dataclass
class RolloutConfig:
    """Generation with the in-process vLLM engine."""

    n: int = 8
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature (also used for the trainer's log-probs)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k sampling; -1 = off."""
    max_response_length: int = 64
    """Response tokens at most."""
    tensor_parallel_size: int = 1
    """Ranks that shard one vLLM engine; must divide the world size."""
    dtype: Optional[Literal["float32", "bfloat16"]] = None
    """vLLM's weight and compute dtype; null = model.dtype. bfloat16 under a float32 trainer samples
    from a lower-precision copy of the policy, as GPU setups often do: the train/inference mismatch
    rollout_correction exists for (on CPU, bf16 generation is about 4x slower than fp32)."""
    max_model_len: int = 512
    """vLLM's context length; must hold data.max_prompt_length + max_response_length."""
    kv_cache_gb: float = 0.5
    """CPU only: KV cache size per engine in GiB (vLLM's auto sizing would take most of the RAM)."""
    gpu_memory_utilization: float = 0.5
    """Accelerators: vLLM's share of device memory (its weights + KV cache)."""
    sleep_level: Optional[Literal[0, 1, 2]] = None
    """What vLLM frees while training: 0 the KV cache; 1 also the weights (kept in host memory);
    2 also the weights (discarded; the full sync before each generation refills them).
    null = 2 on accelerators; CPU has no sleep mode and frees the KV cache buffer only."""
    free_kv_cache: bool = True
    """Release vLLM's memory while training."""
    emulate_sleep: bool = False
    """CPU only, for tests and debugging: the CPU engine sleeps as a GPU's does (vLLM has no sleep mode
    on CPU). sleep_level 1 moves vLLM's weights out and back, 2 discards them (NaN until the next full
    push; null = 2 as on accelerators), judges sleep by freeing their storages; the KV cache is freed
    at every level. See rlcore/rollout/cpu_sleep.py."""
    emulate_ascend_moe: bool = False
    """CPU only, with emulate_sleep: a mixture-of-experts engine treats its experts as vllm-ascend 0.23
    does on an NPU: after loading they live in the NPU kernel's layout, and each wake-up swaps them
    for transposed views, which the engine puts back before the sync. See rlcore/rollout/expert_layout.py."""
    sync_bucket_mb: float = 64.0
    """Weight sync: MiB gathered per collective; peak extra memory about 2 buckets."""
    weight_load: Literal["auto", "reload", "direct"] = "auto"
    """How synced weights enter vLLM: reload (vLLM's reload_weights; CPU needs it: linear weights
    are repacked there) or direct (model.load_weights, no extra copy; refused for mixture-of-experts
    models, whose experts vLLM re-lays out after loading). auto = direct on cuda/npu, reload on cpu
    and for MoE models."""
    enforce_eager: Optional[bool] = None
    """Run vLLM without CUDA graphs. null = false on cuda/npu (graphs survive sleep/wake), true on cpu."""
    max_num_seqs: Optional[int] = None
    """vLLM's max concurrent sequences per engine; null = vLLM's default."""
    max_num_batched_tokens: Optional[int] = None
    """vLLM's token budget per scheduler step; null = vLLM's default."""
    enable_prefix_caching: Optional[bool] = None
    """Share the prompt's KV blocks between the n samples of a prompt; null = vLLM's default."""
    enable_chunked_prefill: Optional[bool] = None
    """Let vLLM split a long prompt's prefill over scheduler steps (max_num_batched_tokens each).
    null = vLLM's default on cuda/npu (on), false on cpu; true is refused on cpu (vLLM's CPU runner
    cannot rewind a seeded request's generator after a partial prefill: rollout.engine_keys)."""
    enable_expert_parallel: bool = False
    """Mixture-of-experts models: vLLM shards the routed experts over the engine's tensor_parallel_size
    ranks (E / tp whole experts each) instead of splitting every expert over them; attention stays
    tensor-parallel. Needs tensor_parallel_size > 1 and a MoE model."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """More vLLM EngineArgs for the policy's engine (not judges' or the teacher's), merged last,
    e.g. {max_logprobs: 5, disable_log_stats: false}. Names the rollout sets itself (TP, seed, sleep
    mode, max_model_len, ...) are refused with the key to use; the dry run checks the values."""
    block_size: Optional[int] = None
    """Tokens per KV-cache block (prefix caching shares whole blocks only). null = 32 on cpu (vLLM's CPU
    default, 128, shares no prompt shorter than 128 tokens; 32 made SmolLM2's generate 1.8x faster),
    vLLM's default on cuda/npu. On cpu a multiple of 32."""
    limit_mm_per_prompt: Optional[dict[str, int]] = None
    """Vision-language models: most items of each kind per prompt vLLM accepts (and budgets its
    encoder cache for), e.g. {image: 2, video: 0}. null = the most images a data row has, no video."""
    check_sync: Optional[Literal["off", "warn", "strict"]] = None
    """After every weight sync the trainer and vLLM score a fixed probe (two training prompts);
    above check_sync_tol the run names the first parameter group that differs and warns (warn) or
    stops with exit code 4 (strict). Logged as rollout/sync_probe_max. See rlcore/step/sync_check.py.
    null = warn, or off with LoRA (a LoRA engine of vllm 0.32 cannot score prompt log-probs; the
    adapter shows in rollout/mismatch_* every step)."""
    check_sync_tol: Optional[float] = None
    """Largest |trainer - vLLM| log-prob of a probe token that passes; null = per model.dtype:
    1e-3 float32, 0.1 bfloat16, 0.05 float16."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn, tool-using conversations (rlcore/agent/)."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Your own agent program against an OpenAI-compatible endpoint per rank (docs/agents.md)."""
    partial: PartialConfig = field(default_factory=PartialConfig)
    """Partial rollouts with an early stop (rlcore/step/partial.py)."""
    tool_parser: str = "hermes"
    """vLLM tool parser that reads the model's calls (vllm.tool_parsers: hermes for Qwen2.5/Qwen3
    <tool_call> JSON, llama3_json, pythonic, ...); used with multi_turn.enable and by the agent endpoint
    (rollout.agent) for the responses' tool_calls."""
    check_sync_every: Optional[int] = None
    """Check the first sync and every N-th after it. Each check costs one trainer forward of the
    probe (an FSDP all-gather of the weights, as much as the sync's own gather: 20 ms beside the
    sync's 24 ms on the tiny bench model, 1.0 s per check for SmolLM2-135M on 2 CPU ranks, 3-5% of
    its step) and one small vLLM prefill. null = 1 with check_sync=strict (every sync verified
    before its samples train), 10 with warn: the defects found so far (a stale tied head, split
    q/k/v loads, a stale prefix cache) repeat at every sync, so the first check sees them, and
    rollout/mismatch_* compares the step's own samples every step for free."""

    def __post_init__(self):
        check_positive("rollout", self, "n", "max_response_length", "tensor_parallel_size", "max_model_len",
                        "max_num_seqs", "max_num_batched_tokens", "check_sync_every")
        check(self.temperature > 0, "rollout.temperature", self.temperature,
              "GRPO needs sampling: use a temperature > 0 (e.g. 1.0)")
        check(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "it must be in (0, 1]")
        check(self.max_response_length < self.max_model_len, "rollout.max_response_length",
              self.max_response_length, f"it must be < rollout.max_model_len={self.max_model_len}")
        check(self.sync_bucket_mb > 0, "rollout.sync_bucket_mb", self.sync_bucket_mb,
              "it must be > 0 MiB (e.g. 64; smaller buckets cost more collectives, larger more memory)")
        check(0 < self.gpu_memory_utilization < 1, "rollout.gpu_memory_utilization", self.gpu_memory_utilization,
              "it must be in (0, 1), e.g. 0.5; the trainer's state needs the rest while vLLM is awake")
        check(self.check_sync_tol is None or self.check_sync_tol > 0, "rollout.check_sync_tol", self.check_sync_tol,
              "it must be > 0 (a log-prob difference, e.g. 1e-3 in float32), or null for the dtype's default")
        check_engine_kwargs_keys(self.engine_kwargs)
        # Below max_model_len only with chunked prefill (a prompt then prefills over several steps);
        # where it is null, the device decides (rollout.engine_keys.check_config).
        check(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= self.max_model_len
              or self.enable_chunked_prefill is not False,
              "rollout.max_num_batched_tokens", self.max_num_batched_tokens,
              f"with rollout.enable_chunked_prefill=false it must be >= rollout.max_model_len={self.max_model_len} "
              f"(or null for vLLM's default)")
