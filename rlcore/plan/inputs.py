"""What a memory plan depends on (``PlanInputs``): the model's shape and the run's settings that
size each component, built from a Config by ``rlcore.plan.memory.plan_from_config``. Plain data:
the plan's arithmetic (``rlcore.plan.memory``, ``rlcore.plan.vision``) reads it."""

from __future__ import annotations

from dataclasses import dataclass

from rlcore.plan.judges import JudgePlan
from rlcore.plan.model_shape import ModelShape

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PHASES = ("train", "checkpoint", "sync", "generate")  # the order a run goes through them
COMPONENTS = ("trainer_params", "gradients", "optimizer", "optimizer_load", "reference", "activations",
              "fsdp_gathered", "vllm_weights", "kv_cache", "vllm_activations", "vllm_overhead", "sync_buckets")
JUDGE_COMPONENTS = ("judges", "judges_asleep")  # only in plans with reward.models
TEACHER_COMPONENTS = ("teacher", "teacher_asleep")  # only in plans with distill.teacher


@dataclass(frozen=True)
class PlanInputs:
    """Everything the plan depends on (built from a Config by ``plan_from_config``)."""

    shape: ModelShape
    world: int
    device_gb: float
    device_type: str = "cuda"
    dtype: str = "bfloat16"
    nproc_per_node: int | None = None
    offload_params: bool = True
    offload_optimizer: bool = True
    reference: bool = False
    offload_ref: bool = False
    tp: int = 1
    ep: int = 1
    gpu_memory_utilization: float = 0.5
    sleep_level: int = 2
    free_kv_cache: bool = True
    sync_bucket_mb: float = 64.0
    micro_batch_size: int = 8
    log_prob_micro_batch_size: int | None = None  # algorithm.log_prob_micro_batch_size; None: micro_batch_size
    log_prob_micro_batch_tokens: int | None = None  # algorithm.log_prob_micro_batch_tokens; None: by count
    prompt_len: int = 256
    response_len: int = 64
    max_model_len: int = 512
    gradient_checkpointing: bool = False
    prompts_per_step: int = 8
    n: int = 8
    max_num_batched_tokens: int | None = None  # None: vLLM's default for this device size
    max_num_seqs: int | None = None
    graphs: bool = False  # vLLM captures CUDA/ACL graphs (rollout.enforce_eager false)
    # vision-language models (ignored when shape.vision is None)
    freeze_vision: bool = False  # model.freeze_vision_tower: no gradients or AdamW state for the ViT
    images_per_prompt: int = 1  # most images a prompt has (0: text-only data, data.image_key null)
    vllm_images: int | None = None  # rollout.limit_mm_per_prompt's image limit; None: vLLM's default

    optimizer_bytes: int = 8  # optimizer state per trainable parameter (optim: rlcore.plan.memory.optimizer_bytes)
    optimizer_load_bytes: int = 8  # the same at a resume's peak (rlcore.plan.memory.optimizer_load_bytes)
    lora_rank: int = 0  # lora.rank: only adapters on every decoder linear layer train
    judges: tuple = ()  # JudgePlan of each reward.models entry
    teacher: JudgePlan | None = None  # distill.teacher's engine (a judge engine that returns log-probs)
    oversample: float = 1.0  # rollout.partial: groups in flight per group trained (KV cache, host memory)
    ulysses: int = 1  # parallel.ulysses_size: a group's ranks share each micro-batch, 1/U of its tokens each
    share_prompt: bool = False  # algorithm.share_prompt: under Ulysses the row's dense (T, T) mask
    fsdp: int | None = None  # parallel.fsdp_size (HSDP): the ranks that shard the trainer state; None: all

    @property
    def phase_names(self) -> tuple[str, ...]:
        return PHASES + ("judge",) * bool(self.judges) + ("teacher",) * bool(self.teacher)

    @property
    def components(self) -> tuple[str, ...]:
        return COMPONENTS + JUDGE_COMPONENTS * bool(self.judges) + TEACHER_COMPONENTS * bool(self.teacher)

    @property
    def trainable(self) -> int:
        """Parameters that get gradients and AdamW state (all but a frozen vision tower; LoRA:
        the adapters, r x (in + out) per target layer)."""
        if self.lora_rank:
            s = self.shape
            q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
            per_layer = (s.hidden + q) * 2 + (s.hidden + kv) * 2 + (s.hidden + s.intermediate) * 3
            return self.lora_rank * per_layer * s.layers
        return self.shape.params - self.shape.vision_params() * self.freeze_vision

    @property
    def shard(self) -> int:
        """Ranks one copy of the trainer state is sharded over: parallel.fsdp_size under HSDP (the
        copies are replicated across the world / fsdp_size shard groups), else the world."""
        return self.fsdp or self.world

    @property
    def c(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def dp(self) -> int:
        return max(1, self.world // self.tp)

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def seqs_per_replica(self) -> float:
        return self.prompts_per_step / self.dp * self.n

    @property
    def micro_seqs(self) -> int:
        """Sequences of one micro-batch; a rank (a Ulysses group: its ranks' samples together)
        never trains on more sequences than it holds."""
        per_rank = max(1, int(self.seqs_per_replica // self.tp))
        return min(self.micro_batch_size, per_rank * self.ulysses)

    @property
    def micro_tokens(self) -> int:
        """T: one packed micro-batch."""
        return self.micro_seqs * self.seq_len

    @property
    def log_prob_micro_tokens(self) -> int:
        """T' of one no-gradient micro-batch (old-policy and reference log-probs): its sequences,
        as ``micro_seqs`` counts them, or with a token budget the budget plus one sequence (the
        split balances whole sequences, so a micro-batch may pass the mean by one of them)."""
        held = max(1, int(self.seqs_per_replica // self.tp)) * self.ulysses * self.seq_len
        if self.log_prob_micro_batch_tokens:
            return min(self.log_prob_micro_batch_tokens + self.seq_len, held)
        return min((self.log_prob_micro_batch_size or self.micro_batch_size) * self.seq_len, held)

    def vllm_defaults(self) -> tuple[int, int]:
        """(max_num_batched_tokens, max_num_seqs): vLLM 0.32's offline (LLM class) defaults pick
        16384 / 1024 on devices of >= 70 GB (8192 / 256 below; A100-80GB also gets the smaller)."""
        big = self.device_gb >= 70
        return (self.max_num_batched_tokens or (16384 if big else 8192),
                self.max_num_seqs or (1024 if big else 256))
