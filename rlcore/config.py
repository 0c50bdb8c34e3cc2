"""Typed configuration: one dataclass per concern, parsed by jsonargparse from a YAML file plus
``--section.key value`` overrides. Every check runs before any model is loaded, and a failed
check exits with code 2 and one paragraph naming the key, the value and the fix.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Literal, Optional

from rlcore import advantage


class ConfigError(ValueError):
    """A user mistake in the configuration or inputs; printed without a traceback, exit code 2."""


def check(ok: bool, key: str, value, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {fix}")


def _check_positive(section: str, obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        check(value > 0, f"{section}.{name}", value, "it must be > 0")


@dataclass
class ModelConfig:
    path: str = ""  # local HF folder (config.json + *.safetensors + tokenizer); no hub downloads
    dtype: Literal["float32", "bfloat16"] = "float32"
    gradient_checkpointing: bool = False
    attn_implementation: str = "sdpa"


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    apply_chat_template: bool = False
    system_prompt: Optional[str] = None
    max_prompt_length: int = 256
    truncation: Literal["filter", "error"] = "filter"
    skip_bad_rows: bool = False
    shuffle: bool = True
    seed: int = 0

    def __post_init__(self):
        _check_positive("data", self, "max_prompt_length")


@dataclass
class RolloutConfig:
    n: int = 8  # samples per prompt (the GRPO group size)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_response_length: int = 64
    tensor_parallel_size: int = 1
    max_model_len: int = 512
    kv_cache_gb: float = 0.5  # CPU: explicit KV cache size per engine
    gpu_memory_utilization: float = 0.5  # accelerators: vLLM's share of device memory
    # What release frees while training (accelerators; CPU has no sleep mode and frees only the
    # KV cache buffer): 0 the KV cache, 1 also the weights (kept in host memory), 2 also the
    # weights (discarded; the full sync before each generation refills them). None = 2.
    sleep_level: Optional[Literal[0, 1, 2]] = None
    free_kv_cache: bool = True  # release vLLM's memory while training
    # Weight sync: MiB gathered per collective; peak extra memory ~2 buckets (or 2x the largest
    # layer block, e.g. the embedding, when that is bigger). 64 pipelines well on CPU and GPUs.
    sync_bucket_mb: float = 64.0
    # How synced weights enter vLLM: reload (reload_weights; every device) or direct
    # (model.load_weights, no extra copy; CUDA only). auto = direct on CUDA, reload elsewhere.
    weight_load: Literal["auto", "reload", "direct"] = "auto"

    def __post_init__(self):
        _check_positive("rollout", self, "n", "max_response_length", "tensor_parallel_size", "max_model_len")
        check(self.temperature > 0, "rollout.temperature", self.temperature,
              "GRPO needs sampling: use a temperature > 0 (e.g. 1.0)")
        check(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "it must be in (0, 1]")
        check(self.max_response_length < self.max_model_len, "rollout.max_response_length",
              self.max_response_length, f"it must be < rollout.max_model_len={self.max_model_len}")
        check(self.sync_bucket_mb > 0, "rollout.sync_bucket_mb", self.sync_bucket_mb,
              "it must be > 0 MiB (e.g. 64; smaller buckets cost more collectives, larger more memory)")


@dataclass
class OffloadConfig:
    """Trainer state moved to host memory while vLLM generates. None = auto: on for cuda/npu
    (frees device memory for vLLM's weights and KV cache), off on CPU (the host is the device:
    the move would copy nothing and free nothing)."""

    params: Optional[bool] = None
    optimizer: Optional[bool] = None

    def resolve(self, device_type: str) -> tuple[bool, bool]:
        """(params, optimizer) for this device."""
        auto = device_type != "cpu"
        return (auto if self.params is None else self.params,
                auto if self.optimizer is None else self.optimizer)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    norm_by_std: bool = True  # False: Dr.GRPO
    policy_loss: str = "vanilla"
    clip_low: float = 0.2
    clip_high: float = 0.2  # > clip_low: DAPO clip-higher
    dual_clip_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    kl_loss_coef: float = 0.0  # > 0 builds a frozen reference policy
    kl_loss_type: str = "low_var_kl"
    entropy_coef: float = 0.0
    ppo_epochs: int = 1
    mini_batches: int = 1  # optimizer steps per epoch
    micro_batch_size: int = 8  # sequences per forward/backward on each rank
    gamma: float = 1.0  # reinforce_pp discount
    # DAPO overlong shaping: reward -= (L - (max_len - buffer)) / buffer * factor past max_len - buffer
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    mask_truncated: bool = False  # drop responses cut at max_response_length from the loss
    # DAPO dynamic sampling: drop groups whose rewards are all equal and sample more prompts
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3

    def __post_init__(self):
        for key, value, valid in (
            ("adv_estimator", self.adv_estimator, advantage.ADV_ESTIMATORS),
            ("policy_loss", self.policy_loss, advantage.POLICY_LOSSES),
            ("loss_agg_mode", self.loss_agg_mode, advantage.AGG_MODES),
            ("kl_loss_type", self.kl_loss_type, advantage.KL_KINDS),
        ):
            check(value in valid, f"algorithm.{key}", value, f"choose one of {', '.join(valid)}")
        _check_positive("algorithm", self, "ppo_epochs", "mini_batches", "micro_batch_size")
        check(0 <= self.clip_low < 1, "algorithm.clip_low", self.clip_low, "it must be in [0, 1)")
        check(self.clip_high >= 0, "algorithm.clip_high", self.clip_high, "it must be >= 0")
        check(self.dual_clip_c > 1, "algorithm.dual_clip_c", self.dual_clip_c, "it must be > 1 (3.0 is usual)")
        check(self.kl_loss_coef >= 0, "algorithm.kl_loss_coef", self.kl_loss_coef, "it must be >= 0")
        check(self.overlong_buffer_len >= 0, "algorithm.overlong_buffer_len", self.overlong_buffer_len,
              "it must be >= 0 (0 disables overlong shaping)")
        check(self.max_sampling_rounds >= 1, "algorithm.max_sampling_rounds", self.max_sampling_rounds,
              "it must be >= 1")


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0

    def __post_init__(self):
        check(self.lr > 0, "optim.lr", self.lr, "it must be > 0 (1e-6 is typical for LLMs)")
        check(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "it must be >= 0")
        check(self.grad_clip > 0, "optim.grad_clip", self.grad_clip, "it must be > 0")
        check(all(0 <= b < 1 for b in self.betas), "optim.betas", list(self.betas),
              "each beta must be in [0, 1), e.g. [0.9, 0.999]")
        check(self.eps > 0, "optim.eps", self.eps, "it must be > 0 (1e-8 is usual)")


@dataclass
class RewardConfig:
    # name -> weight of built-in rewards (see rlcore.rewards.REWARDS) and "custom" (= reward.fn),
    # summed. Default: {math: 1.0}, or {custom: 1.0} when reward.fn is set.
    components: Optional[dict[str, float]] = None
    fn: Optional[str] = None  # "package.module:function" or "path/file.py:function" (rlcore/rewards.py)
    timeout_s: Optional[float] = None  # per call of reward.fn; None = no limit
    error_value: float = 0.0  # reward of a sample whose reward call raised or timed out

    def __post_init__(self):
        from rlcore.rewards import CUSTOM, REWARDS, load_custom_fn

        if self.components is None:
            self.components = {CUSTOM: 1.0} if self.fn else {"math": 1.0}
        check(len(self.components) > 0, "reward.components", self.components, "name at least one reward")
        for name in self.components:
            check(name in REWARDS or name == CUSTOM, "reward.components", name,
                  f"choose from {', '.join(REWARDS)}, or {CUSTOM} together with reward.fn")
        check(CUSTOM not in self.components or self.fn, "reward.components", CUSTOM,
              "the custom component needs reward.fn=package.module:function")
        if self.fn:
            check(CUSTOM in self.components, "reward.fn", self.fn,
                  f"reward.components lists no {CUSTOM!r} entry; add {CUSTOM}: 1.0 (or leave components unset)")
            try:
                load_custom_fn(self.fn)
            except ValueError as e:
                check(False, "reward.fn", self.fn, str(e))
        check(self.timeout_s is None or self.timeout_s > 0, "reward.timeout_s", self.timeout_s,
              "it must be > 0 seconds (or unset for no limit)")


@dataclass
class ParallelConfig:
    device: Literal["auto", "cuda", "npu", "cpu"] = "auto"
    timeout_s: float = 1800.0  # process-group timeout: a hung collective becomes an error


@dataclass
class CheckpointConfig:
    save_every: int = 0  # steps; 0 = only at the end
    resume: str = "auto"  # auto | never | PATH
    keep_last: int = 2
    save_hf_final: bool = True
    hf_every: int = 0  # steps between HF safetensors exports to {output_dir}/hf/step_N; 0 = none
    hf_dtype: Literal["float32", "bfloat16"] = "float32"  # of every HF export (hf_every and hf_final)

    def __post_init__(self):
        check(self.save_every >= 0, "checkpoint.save_every", self.save_every, "it must be >= 0")
        check(self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, "keep at least 1")
        check(self.hf_every >= 0, "checkpoint.hf_every", self.hf_every, "it must be >= 0 (0 = no periodic export)")
        check(bool(self.resume.strip()), "checkpoint.resume", self.resume,
              "use auto, never, or the path of a checkpoint folder")


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    console_every: int = 1
    switch_trace: bool = False  # log every step of every phase switch (rank, order, what it did, seconds)


@dataclass
class TrainerConfig:
    total_steps: int = 10
    prompts_per_step: int = 8  # global, over all data-parallel rollout replicas
    output_dir: str = "outputs/run"
    seed: int = 0
    val_every: int = 0  # steps between validations on data.val_files (and at the last step); 0 = none
    val_before_train: bool = False  # validate the initial model (step 0)
    # SIGTERM/SIGUSR1: checkpoint at the next phase boundary and exit 75 within this many seconds
    # (torchrun's --shutdown-timeout and Slurm's --signal lead time must be longer).
    preempt_grace_s: float = 120.0
    max_consecutive_skips: int = 5  # steps in a row with a non-finite loss/grad norm before the run stops (exit 3)
    watchdog_s: float = 600.0  # report a phase running longer than this, naming phase and rank; 0 = off

    def __post_init__(self):
        _check_positive("trainer", self, "total_steps", "prompts_per_step", "preempt_grace_s",
                        "max_consecutive_skips")
        check(self.watchdog_s >= 0, "trainer.watchdog_s", self.watchdog_s, "it must be >= 0 (0 = no watchdog)")
        check(self.val_every >= 0, "trainer.val_every", self.val_every, "it must be >= 0 (0 = no periodic validation)")


@dataclass
class ValConfig:
    """Validation generations on data.val_files: greedy pass@1, and mean@n with sampling when n > 1."""

    n: int = 1  # > 1 adds n samples per prompt at val.temperature -> val/mean@n and val/pass@n
    temperature: float = 1.0  # of the n > 1 samples (the greedy pass always uses 0)
    top_p: float = 1.0
    max_samples: int = 0  # validation prompts used (the first ones); 0 = all
    max_response_length: int = 0  # 0 = rollout.max_response_length
    num_examples: int = 8  # greedy generations of the first val prompts, written to output_dir/val/step_N.jsonl

    def __post_init__(self):
        _check_positive("val", self, "n", "temperature")
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
    optim: OptimConfig = field(default_factory=OptimConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    val: ValConfig = field(default_factory=ValConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def validate_against_world(cfg: Config, world_size: int) -> None:
    """Checks across sections, against the world size and the files on disk; before any model loads."""
    tp = cfg.rollout.tensor_parallel_size
    check(world_size % tp == 0, "rollout.tensor_parallel_size", tp,
          f"it must divide the world size {world_size} (e.g. 1 or {world_size})")
    dp = world_size // tp
    check(cfg.trainer.prompts_per_step % dp == 0, "trainer.prompts_per_step", cfg.trainer.prompts_per_step,
          f"it must be divisible by the {dp} rollout replicas (world size / tensor_parallel_size)")
    per_rank = cfg.trainer.prompts_per_step // dp * cfg.rollout.n
    check(per_rank % tp == 0, "rollout.n", cfg.rollout.n,
          f"prompts per replica x rollout.n = {per_rank} must split evenly over tensor_parallel_size={tp}")
    per_rank //= tp
    check(per_rank % cfg.algorithm.mini_batches == 0, "algorithm.mini_batches", cfg.algorithm.mini_batches,
          f"it must divide the {per_rank} sequences each rank trains on per step")
    check(len(cfg.data.train_files) > 0, "data.train_files", cfg.data.train_files,
          "list at least one JSONL or Parquet file")
    check(os.path.isfile(os.path.join(cfg.model.path, "config.json")), "model.path", cfg.model.path,
          "no config.json there; point it to a local HF model folder (scripts/ can make one)")
    check(any(f.endswith(".safetensors") for f in os.listdir(cfg.model.path)), "model.path", cfg.model.path,
          "it holds no *.safetensors weights; weights are read only from safetensors (re-save the model with "
          "save_pretrained(..., safe_serialization=True))")
    context = _model_context(cfg.model.path)
    check(context is None or cfg.rollout.max_model_len <= context, "rollout.max_model_len", cfg.rollout.max_model_len,
          f"the model's context (max_position_embeddings in config.json) is {context}; use at most that")
    check(not os.path.exists(cfg.trainer.output_dir) or os.path.isdir(cfg.trainer.output_dir),
          "trainer.output_dir", cfg.trainer.output_dir, "it exists and is not a folder; choose a folder path")
    for i, path in enumerate(cfg.data.train_files + cfg.data.val_files):
        check(os.path.isfile(path), "data.train_files" if i < len(cfg.data.train_files) else "data.val_files",
              path, "the file does not exist")
    check(cfg.algorithm.overlong_buffer_len < cfg.rollout.max_response_length, "algorithm.overlong_buffer_len",
          cfg.algorithm.overlong_buffer_len,
          f"it must be < rollout.max_response_length={cfg.rollout.max_response_length}")
    needed = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    check(needed <= cfg.rollout.max_model_len, "rollout.max_model_len", cfg.rollout.max_model_len,
          f"it must hold data.max_prompt_length + rollout.max_response_length = {needed}")
    _validate_val(cfg)


def _model_context(model_path: str) -> int | None:
    """max_position_embeddings of the model's config.json (None when it does not say)."""
    import json

    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path={model_path!r} is invalid: its config.json does not parse as JSON "
                          f"({e}); re-export the model folder") from e
    value = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return value if isinstance(value, int) else None


def _validate_val(cfg: Config) -> None:
    t = cfg.trainer
    if t.val_every or t.val_before_train:
        check(len(cfg.data.val_files) > 0, "data.val_files", cfg.data.val_files,
              "validation is on (trainer.val_every / trainer.val_before_train): list at least one file, "
              "or set trainer.val_every=0 and trainer.val_before_train=false")
    needed = cfg.data.max_prompt_length + (cfg.val.max_response_length or cfg.rollout.max_response_length)
    check(needed <= cfg.rollout.max_model_len, "val.max_response_length", cfg.val.max_response_length,
          f"data.max_prompt_length + val.max_response_length = {needed} must fit rollout.max_model_len="
          f"{cfg.rollout.max_model_len}")


def build_parser():
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(
        prog="train_grpo.py", exit_on_error=False, default_env=False,
        description="Colocated GRPO trainer: VeOmni FSDP2 policy + in-process vLLM, launched by torchrun.",
    )
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config file")
    parser.add_class_arguments(Config, nested_key=None, as_group=False)
    return parser


def parse_config(argv: list[str] | None = None) -> Config:
    """Parse and validate; on a user mistake print one paragraph and exit with code 2."""
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
        cfg = parser.instantiate(ns)
        return Config(**{k: getattr(cfg, k) for k in Config.__dataclass_fields__})
    except SystemExit:
        raise
    except Exception as e:  # jsonargparse wraps __post_init__ errors; show the user's part only
        fail(_clean_message(e, argv if argv is not None else sys.argv[1:]))


# jsonargparse message -> how to fix it (its messages name the key and value, not the fix)
_PARSER_FIXES = (
    ("unrecognized arguments", "check the key's spelling; `train_grpo.py --print_config` lists every valid key"),
    ("does not accept option", "check the key's spelling; `train_grpo.py --print_config` lists every valid key"),
    ("File does not exist", "pass an existing YAML file to --config"),
    ("Expected a", "give a value of that type; `train_grpo.py --help` shows each key's type"),
    ("Does not validate", "give a value of that type; `train_grpo.py --help` shows each key's type"),
)


def _clean_message(e: Exception, argv: list[str]) -> str:
    msg = str(e).strip()
    for line in msg.splitlines():
        if "is invalid:" in line:
            return line.strip()
    one_line = " ".join(part.strip() for part in msg.splitlines() if part.strip())
    if "Problems parsing config" in msg:
        files = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"]
        return (f"a --config file ({', '.join(files)}) is not valid YAML: "
                f"{one_line.removeprefix('Problems parsing config:').strip()}; fix its syntax")
    for pattern, fix in _PARSER_FIXES:
        if pattern in msg:
            return f"{one_line}; {fix}"
    return one_line


def fail(message: str) -> None:
    """Print a user-facing error (once, from every rank's stderr is fine) and exit with code 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)
