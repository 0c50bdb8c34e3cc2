"""The run's config sections: one dataclass per concern, parsed by jsonargparse
(``rlcore.config.cli``) from a YAML file plus ``--section.key value`` overrides.

Each field's docstring is its help text (``train_grpo.py --help`` shows it with the default).
``__post_init__`` only checks; it never fills in a value, because jsonargparse builds every
section once with its defaults before the YAML arrives (a default filled in there would look
like a user's choice). Defaults that depend on another field or on the device (``None`` or
``"auto"`` below) are filled in once, after parsing, by ``resolve()``. Every check runs before
any model loads; a failed one exits with code 2 and one paragraph naming the key, the value and
the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from rlcore.agent.config import EnvConfig
from rlcore.algo.config import AlgorithmConfig, ExplorationConfig, RolloutCorrectionConfig
from rlcore.config.lora import LoraConfig
from rlcore.config.rollout import RolloutConfig
from rlcore.distill.config import DistillConfig
from rlcore.errors import check, check_positive
from rlcore.task.config import DataConfig


@dataclass
class ModelConfig:
    """The policy model."""

    path: str = ""
    """Local HF folder (config.json, *.safetensors, tokenizer files); nothing is downloaded."""
    dtype: Optional[Literal["float32", "bfloat16"]] = None
    """Compute dtype of the trainer and weight dtype of vLLM (master weights and optimizer state
    stay float32). null = bfloat16 on cuda/npu, float32 on cpu."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer in backward (less activation memory, ~30% more compute)."""
    attn_implementation: str = "auto"
    """Training attention over packed sequences: auto (on CUDA the first flash entry point that
    imports: flash_attention_2, _3, _4 (flash-attn-4, Hopper/Blackwell); npu: flash_attention_2 via
    torch_npu; else sdpa, with a warning on accelerators), sdpa, eager, flash_attention_2/_3/_4."""
    freeze_vision_tower: bool = False
    """Vision-language models: keep the vision tower (the ``visual`` module: patch embedding, blocks,
    mergers) fixed and train the language model only."""
    moe_implementation: str = "auto"
    """Experts kernel of a mixture-of-experts model: auto (VeOmni's fused kernel: triton on cuda,
    npu on Ascend; torch_ep on cpu), torch_ep (pure PyTorch, expert-parallel, any device),
    triton, quack, npu, eager (no expert parallelism). Ignored for dense models."""
    trust_remote_code: bool = False
    """Run the model folder's own Python code (config.json auto_map: configuration_*.py, modeling_*.py) in
    the trainer, vLLM and the tokenizer. Off, such a folder stops the run at start-up; read that code
    before turning this on. Policy only: judges and the teacher load no custom code (rlcore/engine/remote_code.py)."""

    def __post_init__(self):
        check(bool(self.attn_implementation), "model.attn_implementation", self.attn_implementation,
              "use auto, sdpa, flash_attention_2 or eager")


@dataclass
class OffloadConfig:
    """Trainer state moved to host memory while vLLM generates (null = auto: on for cuda/npu, where
    it frees device memory for vLLM; off on cpu, where the host is the device)."""

    params: Optional[bool] = None
    """Offload the policy's parameter shards while generating."""
    optimizer: Optional[bool] = None
    """Offload the optimizer state while generating."""
    ref: Optional[bool] = None
    """Keep the reference policy (kl_loss_coef > 0) on the host outside its forward; null = as params."""


@dataclass
class OptimConfig:
    """The optimizer (VeOmni's build_optimizer) and its learning-rate schedule."""

    optimizer: Literal["adamw", "anyprecision_adamw"] = "adamw"
    """adamw: torch AdamW, fp32 state (8 bytes per trained parameter). anyprecision_adamw: VeOmni's
    AnyPrecisionAdamW (llama-recipes): momentum, variance and a Kahan compensation buffer in
    optim.state_dtype (bf16: 6 bytes per trained parameter). Master weights stay fp32 either way."""
    state_dtype: Optional[Literal["bfloat16", "float32"]] = None
    """anyprecision_adamw only: dtype of its momentum, variance and compensation buffer; null = bfloat16."""
    kahan_summation: Optional[bool] = None
    """anyprecision_adamw only: Kahan-compensated weight update (the update goes through the
    compensation buffer); null = true."""
    lr: float = 1e-6
    """Peak learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay (every parameter)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: constant, or cosine down to min_lr_ratio x lr at the last step."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up."""
    min_lr_ratio: float = 0.0
    """Final lr of the cosine schedule, as a fraction of lr."""
    grad_clip: float = 1.0
    """Max global gradient norm."""

    def __post_init__(self):
        check(self.lr > 0, "optim.lr", self.lr, "it must be > 0 (1e-6 is typical for LLMs)")
        check(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "it must be >= 0")
        check(self.grad_clip > 0, "optim.grad_clip", self.grad_clip, "it must be > 0")
        check(all(0 <= b < 1 for b in self.betas), "optim.betas", list(self.betas),
              "each beta must be in [0, 1), e.g. [0.9, 0.999]")
        check(self.eps > 0, "optim.eps", self.eps, "it must be > 0 (1e-8 is usual)")
        for key in ("state_dtype", "kahan_summation"):
            value = getattr(self, key)
            check(value is None or self.optimizer == "anyprecision_adamw", f"optim.{key}", value,
                  f"it is an anyprecision_adamw option and optim.optimizer is {self.optimizer} (fp32 state); set "
                  f"optim.optimizer: anyprecision_adamw, or leave optim.{key} unset")


@dataclass
class RewardConfig:
    """Rule-based and custom rewards (rlcore/task/rewards.py)."""

    components: Optional[dict[str, float]] = None
    """name -> weight of the built-in rewards and "custom" (= reward.fn), summed. verl = verl's scorer
    picked by each row's data_source (gsm8k, MATH, math_dapo/aime, PRIME/numina, geo3k, Search-R1).
    null = {custom: 1.0} when reward.fn is set, else {verl: 1.0} when the training files hold verl's
    rows (data_source, reward_model.ground_truth), else {math: 1.0}."""
    fn: Optional[str] = None
    """Your reward: "package.module:function" or "path/file.py:function". Signatures (read from its
    parameters): fn(response, answer), a batched fn(responses, answers), or verl's
    compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) and its batched
    form (data_sources, solution_strs, ...); returns a number or a dict with score (rlcore/task/reward_fn.py)."""
    fn_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of every reward.fn call (verl's custom_reward_function.reward_kwargs)."""
    timeout_s: Optional[float] = None
    """Per call of reward.fn; null = no limit."""
    error_value: float = 0.0
    """Reward of a sample whose reward call raised or timed out."""
    models: list[Any] = field(default_factory=list)
    """Model-based rewards (rlcore/judge): entries {name, path, kind: generative|discriminative,
    template, parser, ...} (fields in rlcore/judge/config.py); each is a component whose weight is
    reward.components[name], scored by its own in-process vLLM engine, asleep outside scoring."""

    def __post_init__(self):
        from rlcore.judge.config import parse_judges
        from rlcore.task.reward_fn import CustomReward
        from rlcore.task.rewards import CUSTOM, REWARDS

        judges = [j.name for j in parse_judges(self.models)]
        for name in judges:
            check(name not in REWARDS and name not in (CUSTOM, "env"), "reward.models.name", name,
                  "it is a built-in component's name; give the judge another name")
        components = self.effective_components()
        check(len(components) > 0, "reward.components", components, "name at least one reward")
        for name in components:
            check(name in REWARDS or name in (CUSTOM, "env", *judges), "reward.components", name,
                  f"choose from {', '.join(REWARDS)}, {CUSTOM} together with reward.fn, env with env.cls"
                  f"{', or a reward.models name: ' + ', '.join(judges) if judges else ''}")
        check(CUSTOM not in components or self.fn, "reward.components", CUSTOM,
              "the custom component needs reward.fn=package.module:function")
        if self.fn:
            check(CUSTOM in components, "reward.fn", self.fn,
                  f"reward.components lists no {CUSTOM!r} entry; add {CUSTOM}: 1.0 (or leave components unset)")
            try:
                CustomReward(self.fn, self.fn_kwargs)  # loads it and binds the call it will get
            except ValueError as e:
                check(False, "reward.fn", self.fn, str(e))
        check(not self.fn_kwargs or self.fn, "reward.fn_kwargs", self.fn_kwargs,
              "they are keyword arguments of reward.fn, which is not set; set reward.fn or drop them")
        check(self.timeout_s is None or self.timeout_s > 0, "reward.timeout_s", self.timeout_s,
              "it must be > 0 seconds (or unset for no limit)")

    def judges(self):
        """``models`` as checked rlcore.judge.config.JudgeConfig entries."""
        from rlcore.judge.config import parse_judges

        return parse_judges(self.models)

    def effective_components(self, verl_rows: bool = False) -> dict[str, float]:
        """components, or their default (``verl_rows``: the training files hold verl's rows)."""
        from rlcore.task.rewards import CUSTOM

        if self.components is not None:
            return dict(self.components)
        return {CUSTOM: 1.0} if self.fn else {"verl": 1.0} if verl_rows else {"math": 1.0}


@dataclass
class ParallelConfig:
    """Devices and process groups."""

    device: Literal["auto", "cuda", "npu", "cpu"] = "auto"
    """auto = cuda, else npu, else cpu."""
    timeout_s: float = 1800.0
    """Process-group timeout: a hung collective becomes an error after this long."""
    ep_size: int = 1
    """Expert parallelism of a mixture-of-experts policy: the experts are split over the ep_size
    ranks of each EP group (it divides the world size and the expert count); FSDP2 shards the
    rest over all ranks. 1 = no expert parallelism."""
    ulysses_size: int = 1
    """Ulysses sequence parallelism of the train phase: each group of ulysses_size consecutive ranks
    trains the same packed rows, 1/ulysses_size of each row's tokens per rank (attention all-to-alls
    the heads), so one rank holds the activations of a fraction of a long sequence. It divides the
    world size and the attention heads. Token budgets (algorithm.micro_batch_tokens) are per group.
    vLLM is unaffected (rollout.tensor_parallel_size). 1 = off."""
    fsdp_size: Optional[int] = None
    """HSDP (verl's fsdp_config.fsdp_size): FSDP2 shards the trainer state (weights, gradients,
    optimizer) over blocks of fsdp_size consecutive ranks and replicates it across the blocks, so a
    shard group can stay inside a node; per-rank trainer memory is 1/fsdp_size of it, not 1/world.
    It divides the world size and is a multiple of ulysses_size and of ep_size (VeOmni's mesh).
    null = the world size: plain FSDP over every rank."""

    def __post_init__(self):
        check(self.ep_size >= 1, "parallel.ep_size", self.ep_size, "it must be >= 1 (1 = no expert parallelism)")
        check(self.ulysses_size >= 1, "parallel.ulysses_size", self.ulysses_size,
              "it must be >= 1 (1 = no sequence parallelism)")
        check(self.fsdp_size is None or self.fsdp_size >= 1, "parallel.fsdp_size", self.fsdp_size,
              "it must be >= 1, or null for plain FSDP over every rank")


@dataclass
class CheckpointConfig:
    """Run checkpoints and HF exports."""

    save_every: int = 0
    """Steps between checkpoints; 0 = only at the end (the last step always saves); -1 = never (verl's
    trainer.save_freq=-1): no periodic, final, preemption or divergence checkpoint is written, so a
    restart has nothing of this run to resume from (a preempted run still exits 75, a diverged one 3).
    HF exports are not checkpoints and keep their own keys: save_hf_final and hf_every still export."""
    resume: str = "auto"
    """auto (newest complete checkpoint in trainer.output_dir, else fresh), never, or a path."""
    resume_config_mismatch: Literal["refuse", "accept"] = "refuse"
    """A checkpoint that resume=auto finds whose run was configured differently in a key that changes
    what is trained (model, data, rollout sampling, algorithm, optimizer, reward, seed, ...; not
    total_steps, logging, paths, validation, engine sizes): refuse (exit 2, naming each key and both
    values) or accept (resume it, saying the differences). A checkpoint named by path is resumed as
    named (the differences said). docs/checkpoints.md."""
    keep_last: int = 2
    """Complete checkpoints kept."""
    save_hf_final: bool = True
    """Export an HF safetensors folder to {output_dir}/hf_final at the end: a model for inference or
    evaluation, not a checkpoint (no optimizer or data position; a run cannot resume from it), so
    save_every=-1 does not turn it off; set this to false for no output at all."""
    hf_every: int = 0
    """Steps between HF exports to {output_dir}/hf/step_N; 0 = none."""
    hf_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of every HF export."""
    merge_lora: bool = False
    """LoRA: HF exports are the PEFT adapter (adapter_config.json + adapter_model.safetensors,
    what PEFT, vLLM's LoRARequest and lora.path load); true adds the merged model in merged/, a
    plain checkpoint of base + adapter that transformers and vLLM load alone."""
    on_low_space: Literal["stop", "skip"] = "stop"
    """Before each checkpoint the free space of trainer.output_dir is checked against the last
    checkpoint's size (plus the HF export when one is due). stop: the run says so and exits 74 with
    the newest complete checkpoint intact; skip: this checkpoint (and export) is skipped with a
    warning and the run goes on, to checkpoint at the next due step if there is room then."""

    def __post_init__(self):
        check(self.save_every >= -1, "checkpoint.save_every", self.save_every,
              "it must be >= 0 (steps between checkpoints; 0 = only at the end) or -1 (never save)")
        check(self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, "keep at least 1")
        check(self.hf_every >= 0, "checkpoint.hf_every", self.hf_every, "it must be >= 0 (0 = no periodic export)")
        check(bool(self.resume.strip()), "checkpoint.resume", self.resume,
              "use auto, never, or the path of a checkpoint folder")


@dataclass
class WandbConfig:
    """Weights & Biases (logging.trackers contains wandb). Offline unless asked: no network by default."""

    project: str = "rlcore"
    """The wandb project."""
    name: Optional[str] = None
    """The run's name; null = the name of trainer.output_dir."""
    group: Optional[str] = None
    """Groups runs in the wandb UI (e.g. the segments of a resumed run, or a sweep)."""
    tags: list[str] = field(default_factory=list)
    """Tags of the run."""
    mode: str = "offline"
    """offline (files only; upload later with `wandb sync`), online (opens a connection to the wandb
    server) or disabled. The WANDB_MODE environment variable, when set, wins (said at start-up)."""
    dir: Optional[str] = None
    """Folder wandb writes its wandb/ folder into; null = trainer.output_dir ({output_dir}/wandb/)."""

    def __post_init__(self):
        from rlcore.trackers import WANDB_MODES

        check(self.mode in WANDB_MODES, "logging.wandb.mode", self.mode, f"use one of {', '.join(WANDB_MODES)}")
        check(bool(self.project), "logging.wandb.project", self.project, "give a project name")


@dataclass
class LoggingConfig:
    """metrics.jsonl, the console, and the trackers (TensorBoard, wandb, MLflow)."""

    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Where metrics go besides metrics.jsonl (rank 0 only): tensorboard ({output_dir}/tensorboard),
    wandb (logging.wandb), mlflow (a local store in {output_dir}/mlruns or logging.mlflow_uri); [] = none."""
    tensorboard: bool = True
    """false drops tensorboard from logging.trackers (the older switch); with trackers naming more
    than tensorboard, keep it true or leave tensorboard out of trackers."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """The wandb tracker's settings."""
    mlflow_uri: Optional[str] = None
    """MLflow tracking URI; null = the local file store file:{output_dir}/mlruns (no server)."""
    mlflow_experiment: str = "rlcore"
    """MLflow experiment the run goes into (created when missing)."""
    console_every: int = 1
    """Steps between console lines."""
    switch_trace: bool = False
    """Print every step of every phase switch (rank, order, what it did, seconds)."""

    def __post_init__(self):
        from rlcore.trackers import TRACKERS

        for name in self.trackers:
            check(name in TRACKERS, "logging.trackers", list(self.trackers),
                  f"unknown tracker {name!r}: valid names are {', '.join(sorted(TRACKERS))}")
        check(len(set(self.trackers)) == len(self.trackers), "logging.trackers", list(self.trackers),
              "name each tracker once")
        check(self.tensorboard or "tensorboard" not in self.trackers or list(self.trackers) == ["tensorboard"],
              "logging.tensorboard", self.tensorboard,
              f"it conflicts with logging.trackers={list(self.trackers)}, which names tensorboard: remove "
              "tensorboard from logging.trackers (logging.tensorboard is then not needed)")
        check(self.console_every > 0, "logging.console_every", self.console_every, "it must be > 0")

    @property
    def enabled_trackers(self) -> list[str]:
        """logging.trackers less tensorboard when logging.tensorboard is false."""
        return [t for t in self.trackers if self.tensorboard or t != "tensorboard"]


@dataclass
class TrainerConfig:
    """The loop."""

    total_steps: Optional[int] = None
    """Training steps of the run (the LR schedule, trainer.val_every's final validation and the
    final checkpoint follow it). null = 10, or computed from trainer.total_epochs when that is set.
    With both set (verl's total_training_steps silently wins over total_epochs), they must agree:
    a mismatch exits 2 naming both; set one of them to null."""
    total_epochs: Optional[int] = None
    """verl's trainer.total_epochs: passes over the training prompts. total_steps is computed at
    start-up, once the data is read: ceil(total_epochs x P / prompts_per_step), P = the prompts kept
    after data.truncation filtering. Epochs run into one another here (a step whose batch crosses
    the end of an epoch takes its rest from the next epoch's shuffle, while verl drops that partial
    batch), so the run draws every prompt total_epochs times, and its last step tops up with at most
    prompts_per_step - 1 prompts of one more epoch; when prompts_per_step divides P this is verl's
    total_epochs x (P // prompts_per_step). algorithm.dynamic_sampling and rollout.partial draw more
    prompts a step than prompts_per_step: those runs pass over the data more often than this.
    null = use total_steps."""
    prompts_per_step: int = 8
    """Prompts per step, global over all data-parallel rollout replicas."""
    output_dir: Optional[str] = None
    """Checkpoints, metrics.jsonl, TensorBoard events, HF exports, validation samples. null =
    outputs/<the --config file's name without .yaml> (outputs/run without a --config file), so two
    config files never share a run directory (verl's converted scripts name theirs
    checkpoints/{project_name}/{experiment_name}). checkpoint.resume=auto refuses a checkpoint there
    of a run configured differently (docs/checkpoints.md)."""
    seed: int = 0
    """Seed of the model's randomness and of vLLM's sampling."""
    val_every: int = 0
    """Steps between validations on data.val_files (and at the last step); 0 = none."""
    val_before_train: bool = False
    """Validate the initial model (step 0)."""
    preempt_grace_s: float = 120.0
    """SIGTERM/SIGUSR1: checkpoint at the next phase boundary and exit 75 within this many seconds
    (torchrun's --shutdown-timeout and Slurm's --signal lead time must be longer)."""
    max_consecutive_skips: int = 5
    """Steps in a row with a non-finite loss or gradient norm before the run stops (exit 3)."""
    watchdog_s: float = 600.0
    """Report a phase running longer than this, naming phase and rank; 0 = off."""
    balance_batch: bool = False
    """verl's trainer.balance_batch: after the advantages, move samples between the train phase's
    data-parallel ranks (a Ulysses group counts as one) so each trains about as many prompt+response
    tokens; each mini-batch is balanced on its own, so the update's gradient is unchanged. Spread
    per mini-batch: at most the longest minus the shortest sample. Logs
    perf/rank_tokens_max_over_mean (and _before). verl's default is true; false here keeps existing
    runs' per-rank data (scripts/from_verl.py writes true for verl scripts)."""

    def __post_init__(self):
        check_positive("trainer", self, "total_steps", "total_epochs", "prompts_per_step", "preempt_grace_s",
                        "max_consecutive_skips")
        check(self.watchdog_s >= 0, "trainer.watchdog_s", self.watchdog_s, "it must be >= 0 (0 = no watchdog)")
        check(self.val_every >= 0, "trainer.val_every", self.val_every, "it must be >= 0 (0 = no periodic validation)")


@dataclass
class ValConfig:
    """Validation generations on data.val_files: greedy pass@1, and mean@n with sampling when n > 1."""

    n: int = 1
    """> 1 adds n samples per prompt at val.temperature -> val/mean@n and val/pass@n."""
    temperature: float = 1.0
    """Of the n > 1 samples (the greedy pass always uses 0)."""
    top_p: float = 1.0
    """Of the n > 1 samples."""
    max_samples: int = 0
    """Validation prompts used (the first ones); 0 = all."""
    max_response_length: int = 0
    """Response tokens at most; 0 = rollout.max_response_length."""
    num_examples: int = 8
    """Greedy generations of the first val prompts written to {output_dir}/val/step_N.jsonl."""
    reward_components: Optional[dict[str, float]] = None
    """Components (name -> weight) validation scores with, e.g. a judge (reward.models) or only the
    rule; null = reward.components."""

    def __post_init__(self):
        check_positive("val", self, "n", "temperature")
        check(0 < self.top_p <= 1, "val.top_p", self.top_p, "it must be in (0, 1]")
        for name in ("max_samples", "max_response_length", "num_examples"):
            check(getattr(self, name) >= 0, f"val.{name}", getattr(self, name), "it must be >= 0")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    exploration: ExplorationConfig = field(default_factory=ExplorationConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    val: ValConfig = field(default_factory=ValConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tools: list[Any] = field(default_factory=list)
    """Tools of multi-turn rollouts: built-in names (calculator, python), "path/file.py:function" /
    "package.module:function" (schema from type hints + Google docstring), or {fn: ..., schema: {...}}."""
    env: EnvConfig = field(default_factory=EnvConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
