"""verl's keys and what they become here: the table scripts/from_verl.py converts with and
docs/from_verl.md documents (tests/test_from_verl.py checks that the two name the same keys).

MAPPED: verl key -> (this project's key, meaning here). The key column is what the converter writes;
keys whose conversion is more than a copy are handled by name in from_verl.py (CONVERTERS there).
NO_EFFECT: verl keys that need no key here (what they switch is how this trainer always works).
UNMAPPED: verl key prefixes with no equivalent, and why; the converter lists them and exits 2.
Defaults and aliases checked against verl-project/verl 1dda039 (verl/trainer/config/*.yaml,
verl/trainer/ppo/core_algos.py kl_penalty_forward).
"""

from __future__ import annotations

import json

A = "actor_rollout_ref.actor."
R = "actor_rollout_ref.rollout."
REF = "actor_rollout_ref.ref."
M = "actor_rollout_ref.model."

MAPPED: dict[str, tuple[str, str]] = {
    # data
    "data.train_files": ("data.train_files", "JSONL or Parquet files; verl's one path or list becomes a list"),
    "data.val_files": ("data.val_files", "validation files"),
    "data.train_batch_size": ("trainer.prompts_per_step", "prompts per step (verl counts prompts too; n samples each)"),
    "data.max_prompt_length": ("data.max_prompt_length", "prompt tokens at most"),
    "data.max_response_length": ("rollout.max_response_length", "response tokens; rollout.max_model_len = prompt + response unless given"),
    "data.truncation": ("data.truncation", "error / left / right / middle as in verl"),
    "data.filter_overlong_prompts": ("data.truncation", "True: filter (drop over-long prompts: verl filters before it truncates)"),
    "data.prompt_key": ("data.prompt_key", "row key of the prompt"),
    "data.image_key": ("data.image_key", "row key of the images"),
    "data.shuffle": ("data.shuffle", "shuffle every epoch"),
    "data.seed": ("data.seed", "seed of the shuffle"),
    "data.trust_remote_code": ("model.trust_remote_code", "one switch here for the tokenizer, VeOmni and vLLM"),
    # model
    M + "path": ("model.path", "local HF folder (nothing is downloaded: a hub name must become a local path)"),
    M + "enable_gradient_checkpointing": ("model.gradient_checkpointing", "recompute each layer in backward"),
    M + "trust_remote_code": ("model.trust_remote_code", "load the model folder's own modeling code"),
    M + "lora_rank": ("lora.rank", "LoRA rank (0 = off)"),
    M + "lora.rank": ("lora.rank", "LoRA rank (0 = off)"),
    M + "lora_alpha": ("lora.alpha", "LoRA alpha"),
    M + "lora.alpha": ("lora.alpha", "LoRA alpha"),
    M + "target_modules": ("lora.target_modules", "LoRA target modules"),
    M + "lora_adapter_path": ("lora.path", "start from a PEFT adapter"),
    # actor
    A + "optim.lr": ("optim.lr", "peak learning rate"),
    A + "optim.weight_decay": ("optim.weight_decay", "AdamW weight decay; verl's default 0.01 is written when unset (0.0 here)"),
    A + "optim.betas": ("optim.betas", "AdamW betas"),
    A + "optim.clip_grad": ("optim.grad_clip", "max global gradient norm"),
    A + "optim.grad_clip": ("optim.grad_clip", "max global gradient norm (verl's deprecated name)"),
    A + "optim.lr_warmup_steps": ("optim.warmup_steps", "verl counts training steps (one scheduler step per update); here optimizer steps: x ppo_epochs x mini_batches"),
    A + "optim.lr_warmup_steps_ratio": ("optim.warmup_steps", "int(ratio x total steps) training steps, x ppo_epochs x mini_batches; needs the step count"),
    A + "optim.lr_scheduler_type": ("optim.lr_schedule", "constant or cosine; verl's VeOmni engine defaults to cosine, its FSDP engine to constant"),
    A + "optim.warmup_style": ("optim.lr_schedule", "verl's deprecated name of lr_scheduler_type"),
    A + "optim.lr_decay_style": ("optim.lr_schedule", "verl's older name of lr_scheduler_type"),
    A + "optim.min_lr_ratio": ("optim.min_lr_ratio", "cosine floor as a fraction of lr"),
    A + "optim.lr_min": ("optim.min_lr_ratio", "the VeOmni engine's absolute floor, divided by lr"),
    A + "ppo_mini_batch_size": ("algorithm.mini_batches", "verl counts prompts per mini-batch; here mini-batches per step = train_batch_size / ppo_mini_batch_size"),
    A + "ppo_epochs": ("algorithm.ppo_epochs", "passes over each step's samples"),
    A + "ppo_micro_batch_size_per_gpu": ("algorithm.micro_batch_size", "sequences per forward/backward on each rank"),
    A + "use_dynamic_bsz": ("algorithm.micro_batch_tokens", "True: token-budget micro-batches (with ppo_max_token_len_per_gpu)"),
    A + "ppo_max_token_len_per_gpu": ("algorithm.micro_batch_tokens", "per GPU in verl, per Ulysses group here: x parallel.ulysses_size"),
    A + "use_kl_loss": ("algorithm.kl_loss_coef", "False (verl's default): kl_loss_coef 0, no reference model"),
    A + "kl_loss_coef": ("algorithm.kl_loss_coef", "weight of the KL loss"),
    A + "kl_loss_type": ("algorithm.kl_loss_type", "verl's aliases: kl -> k1, mse -> k2, low_var_kl / k3, abs; full is unmapped (verl raises too)"),
    A + "entropy_coeff": ("algorithm.entropy_coef", "entropy bonus weight"),
    A + "clip_ratio": ("algorithm.clip_low", "both clip_low and clip_high"),
    A + "clip_ratio_low": ("algorithm.clip_low", "PPO clip below 1"),
    A + "clip_ratio_high": ("algorithm.clip_high", "PPO clip above 1"),
    A + "clip_ratio_c": ("algorithm.dual_clip_c", "dual-clip bound"),
    A + "loss_agg_mode": ("algorithm.loss_agg_mode", "the same four modes"),
    A + "policy_loss.loss_mode": ("algorithm.policy_loss", "vanilla or gspo"),
    A + "ulysses_sequence_parallel_size": ("parallel.ulysses_size", "Ulysses group size"),
    A + "fsdp_config.ulysses_sequence_parallel_size": ("parallel.ulysses_size", "Ulysses group size"),
    A + "fsdp_config.param_offload": ("offload.params", "offload parameter shards while generating"),
    A + "fsdp_config.optimizer_offload": ("offload.optimizer", "offload optimizer state while generating"),
    A + "veomni.param_offload": ("offload.params", "offload parameter shards while generating"),
    A + "veomni.optimizer_offload": ("offload.optimizer", "offload optimizer state while generating"),
    A + "fsdp_config.fsdp_size": ("parallel.fsdp_size", "HSDP shard group size; -1 = all ranks (left out)"),
    A + "veomni.fsdp_size": ("parallel.fsdp_size", "HSDP shard group size; -1 = all ranks (left out)"),
    A + "veomni.expert_parallel_size": ("parallel.ep_size", "expert parallelism of the trainer"),
    A + "veomni.ulysses_parallel_size": ("parallel.ulysses_size", "Ulysses group size"),
    A + "veomni.attn_implementation": ("model.attn_implementation", "training attention kernel"),
    A + "freeze_vision_tower": ("model.freeze_vision_tower", "train the language model only"),
    # reference
    REF + "fsdp_config.param_offload": ("offload.ref", "reference policy on the host outside its forward"),
    REF + "veomni.param_offload": ("offload.ref", "reference policy on the host outside its forward"),
    REF + "log_prob_micro_batch_size_per_gpu": ("algorithm.log_prob_micro_batch_size", "one size here for the old-policy and reference forwards: the smaller of the two"),
    REF + "log_prob_use_dynamic_bsz": ("algorithm.log_prob_micro_batch_tokens", "True: token-budget log-prob forwards"),
    REF + "log_prob_max_token_len_per_gpu": ("algorithm.log_prob_micro_batch_tokens", "per GPU in verl, per Ulysses group here; the smaller of rollout's and ref's"),
    # rollout
    R + "name": ("rollout", "vllm only (sglang / trtllm: unmapped)"),
    R + "n": ("rollout.n", "samples per prompt"),
    R + "temperature": ("rollout.temperature", "sampling temperature"),
    R + "top_p": ("rollout.top_p", "nucleus sampling"),
    R + "top_k": ("rollout.top_k", "top-k sampling (-1 off)"),
    R + "tensor_model_parallel_size": ("rollout.tensor_parallel_size", "vLLM TP size"),
    R + "gpu_memory_utilization": ("rollout.gpu_memory_utilization", "vLLM's share of device memory"),
    R + "enforce_eager": ("rollout.enforce_eager", "no CUDA graphs"),
    R + "free_cache_engine": ("rollout.free_kv_cache", "release vLLM's memory while training"),
    R + "max_num_batched_tokens": ("rollout.max_num_batched_tokens", "vLLM's token budget per scheduler step"),
    R + "max_num_seqs": ("rollout.max_num_seqs", "vLLM's concurrent sequences"),
    R + "max_model_len": ("rollout.max_model_len", "vLLM's context length"),
    R + "enable_prefix_caching": ("rollout.enable_prefix_caching", "share prompt KV blocks"),
    R + "enable_chunked_prefill": ("rollout.enable_chunked_prefill", "vLLM's chunked prefill"),
    R + "expert_parallel_size": ("rollout.enable_expert_parallel", "> 1: vLLM's expert parallelism over its TP group (verl's vllm_async_server: enable_expert_parallel = size > 1)"),
    R + "log_prob_micro_batch_size_per_gpu": ("algorithm.log_prob_micro_batch_size", "sequences per no-gradient forward"),
    R + "log_prob_use_dynamic_bsz": ("algorithm.log_prob_micro_batch_tokens", "True: token-budget log-prob forwards"),
    R + "log_prob_max_token_len_per_gpu": ("algorithm.log_prob_micro_batch_tokens", "per GPU in verl, per Ulysses group here: x parallel.ulysses_size"),
    R + "engine_kwargs.vllm": ("rollout.engine_kwargs", "+...engine_kwargs.vllm.X=v: free-form vLLM arguments {X: v}"),
    R + "checkpoint_engine.update_weights_bucket_megabytes": ("rollout.sync_bucket_mb", "weight-sync bucket in MiB"),
    R + "val_kwargs.n": ("val.n", "validation samples per prompt"),
    R + "val_kwargs.temperature": ("val.temperature", "validation temperature"),
    R + "val_kwargs.top_p": ("val.top_p", "validation top-p"),
    # algorithm
    "algorithm.adv_estimator": ("algorithm.adv_estimator", "grpo, rloo, reinforce_plus_plus -> reinforce_pp, reinforce_plus_plus_baseline -> reinforce_pp_baseline"),
    "algorithm.norm_adv_by_std_in_grpo": ("algorithm.norm_by_std", "False = Dr.GRPO"),
    "algorithm.gamma": ("algorithm.gamma", "reinforce_pp discount"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.len": ("algorithm.overlong_buffer_len", "DAPO overlong shaping buffer"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor": ("algorithm.overlong_penalty_factor", "DAPO overlong penalty"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable": ("algorithm.overlong_buffer_len", "False: overlong_buffer_len 0"),
    # trainer
    "trainer.total_epochs": ("trainer.total_steps", "epochs x (rows // train_batch_size), verl's count, when the training files are readable here; else trainer.total_epochs"),
    "trainer.total_training_steps": ("trainer.total_steps", "training steps (wins over total_epochs, as in verl)"),
    "trainer.save_freq": ("checkpoint.save_every", "steps between checkpoints; -1 (verl's default) never"),
    "trainer.test_freq": ("trainer.val_every", "steps between validations; -1 -> 0 (none)"),
    "trainer.val_before_train": ("trainer.val_before_train", "verl's default True is written when there are val files"),
    "trainer.logger": ("logging.trackers", "console is always on here; wandb, mlflow, tensorboard; swanlab unmapped"),
    "trainer.project_name": ("logging.wandb.project", "also logging.mlflow_experiment with mlflow"),
    "trainer.experiment_name": ("logging.wandb.name", "the run's name"),
    "trainer.default_local_dir": ("trainer.output_dir", "checkpoints and logs"),
    "trainer.max_actor_ckpt_to_keep": ("checkpoint.keep_last", "complete checkpoints kept"),
    "trainer.n_gpus_per_node": ("torchrun --nproc_per_node", "a launcher flag here, not a config key"),
    "trainer.nnodes": ("sbatch --nodes", "a launcher flag here (scripts/slurm/train_grpo.sbatch)"),
    "trainer.balance_batch": ("trainer.balance_batch", "reorder samples so ranks get even token counts; verl's default True is written when unset"),
    "trainer.resume_mode": ("checkpoint.resume", "auto -> auto, disable -> never, resume_path -> trainer.resume_from_path"),
    "trainer.resume_from_path": ("checkpoint.resume", "a checkpoint folder"),
    "trainer.log_val_generations": ("val.num_examples", "validation generations written per validation"),
    "trainer.device": ("parallel.device", "cuda or npu"),
    "actor_rollout_ref.nccl_timeout": ("parallel.timeout_s", "process-group timeout in seconds"),
    "model_engine": ("optim.lr_schedule", "veomni: cosine (verl's optim/veomni.yaml); megatron / torchtitan: unmapped"),
}

NO_EFFECT: dict[str, str] = {
    M + "use_remove_padding": "sequences are always packed without padding here",
    M + "use_fused_kernels": "the LM head projects response tokens only here (algorithm.response_only_logits)",
    M + "use_shm": "models load from a local path",
    "data.return_raw_chat": "prompts are rendered here (data.apply_chat_template)",
    "data.dataloader_num_workers": "prompts are read in the trainer's process",
    "data.filter_overlong_prompts_workers": "prompts are read in the trainer's process",
    A + "use_torch_compile": "no torch.compile of the actor here",
    A + "strategy": "fsdp / fsdp2 / veomni: VeOmni's FSDP2 is the only trainer here (megatron: unmapped)",
    REF + "strategy": "the reference is built as the actor",
    A + "veomni.moe_implementation": "fused only (another value: unmapped): model.moe_implementation auto takes VeOmni's fused kernel on cuda/npu",
    A + "veomni.enable_full_shard": "True only (False: unmapped): FSDP2 shards fully here (parallel.fsdp_size for HSDP)",
    REF + "veomni.expert_parallel_size": "the reference is built with the actor's parallel.ep_size",
    R + "disable_log_stats": "vLLM's periodic stats log is off here; rollout/* metrics report generation",
    REF + "use_torch_compile": "no torch.compile here",
    REF + "ulysses_sequence_parallel_size": "the reference forward uses parallel.ulysses_size",
    REF + "fsdp_config.ulysses_sequence_parallel_size": "the reference forward uses parallel.ulysses_size",
    R + "mode": "vLLM runs in-process here (sync and async alike)",
    R + "load_format": "weights are pushed from the trainer at every sync",
    R + "layered_summon": "the sync gathers in buckets (rollout.sync_bucket_mb)",
    R + "calculate_log_probs": "vLLM's log-probs are always kept (rollout_correction)",
    R + "data_parallel_size": "every TP group is one data-parallel engine: world size / tensor_parallel_size",
    R + "multi_stage_wake_up": "the switch order is fixed (rlcore/step/switch.py)",
    R + "val_kwargs.do_sample": "validation is greedy pass@1, plus val.n samples when n > 1",
    R + "engine_kwargs.sglang": "SGLang's arguments; vLLM is the engine here",
    R + "engine_kwargs.trtllm": "TensorRT-LLM's arguments; vLLM is the engine here",
    "actor_rollout_ref.hybrid_engine": "the policy and vLLM are always colocated",
    "algorithm.use_kl_in_reward": "False only (True: unmapped): the KL is a loss here (algorithm.kl_loss_coef)",
    "algorithm.kl_ctrl": "with use_kl_in_reward False verl does not use it",
    "algorithm.lam": "GAE only (a critic)",
    "trainer.critic_warmup": "no critic (0 only)",
    "trainer.use_legacy_worker_impl": "no worker classes here",
    "reward_model.enable": "False only (True: a reward-model worker, unmapped)",
    "reward_model.reward_manager": "naive / dapo rule scoring: reward.components here (math by default)",
    "reward_model.reward_kwargs.max_resp_len": "rollout.max_response_length",
    "reward_model.reward_kwargs.overlong_buffer_cfg.log": "overlong shaping is always logged",
    "reward_model.use_reward_loop": "rewards are scored in the loop here",
}

# NO_EFFECT keys that need no key only at these values (another value is unmapped: verl would run a critic,
# a reward in the KL, a reward-model worker or Megatron).
NO_EFFECT_ONLY = {"algorithm.use_kl_in_reward": [False], "reward_model.enable": [False], "trainer.critic_warmup": [0],
                  A + "strategy": ["fsdp", "fsdp2", "veomni", "dp"], REF + "strategy": ["fsdp", "fsdp2", "veomni", "dp"],
                  A + "veomni.moe_implementation": ["fused"], A + "veomni.enable_full_shard": [True]}

UNMAPPED: dict[str, str] = {
    "critic.": "no critic here: GRPO-family estimators only (PPO with a value model is out of scope)",
    "actor_rollout_ref.actor.megatron.": "Megatron is not a backend here: VeOmni FSDP2 (+ parallel.ulysses_size, parallel.ep_size)",
    "actor_rollout_ref.ref.megatron.": "Megatron is not a backend here: VeOmni FSDP2",
    "actor_rollout_ref.actor.engine.": "Megatron / TorchTitan engine options: VeOmni FSDP2 here",
    "ray_init.": "no Ray here: torchrun starts every rank",
    "ray_kwargs.": "no Ray here: torchrun starts every rank",
    "reward_model.": "no reward-model worker here: reward.models runs judges and reward models on the rollout engine (docs/judges.md)",
    "reward.": "verl's reward settings: reward.components / reward.fn / reward.models here (docs/judges.md)",
    "custom_reward_function.": "reward.fn takes another signature (rlcore/task/rewards.py): port the function, then reward.fn: file.py:function",
    "global_profiler.": "no profiler integration",
    "actor_rollout_ref.actor.profiler.": "no profiler integration",
    "actor_rollout_ref.ref.profiler.": "no profiler integration",
    "actor_rollout_ref.rollout.multi_turn.": "multi-turn is configured with rollout.multi_turn and tools (docs/tools.md)",
    "actor_rollout_ref.rollout.val_kwargs.top_k": "no val.top_k",
    "data.custom_cls.": "no custom dataset class: JSONL or Parquet rows (data.prompt_key, data.answer_key)",
    "data.apply_chat_template_kwargs.": "no chat-template arguments",
    "actor_rollout_ref.model.override_config.": "the model's config.json is used as is",
    "actor_rollout_ref.actor.fsdp_config.": "VeOmni's FSDP2 settings are not exposed (dtype: model.dtype)",
    "actor_rollout_ref.ref.fsdp_config.": "VeOmni's FSDP2 settings are not exposed",
    "actor_rollout_ref.actor.optim.override_optimizer_config.": "no free-form optimizer arguments",
    "actor_rollout_ref.actor.veomni.": "VeOmni's other engine settings are set by this trainer",
    "actor_rollout_ref.ref.veomni.": "VeOmni's other engine settings are set by this trainer",
    "algorithm.rollout_correction.": "rollout_correction.* here has other names (docs/algorithms.md)",
    "transfer_queue.": "no transfer queue: the colocated loop passes tensors in process",
    "hydra.": "Hydra's own settings: this project reads one YAML config",
}

# verl's top-level config sections: a key outside them is not a verl key (an error, not "unmapped").
VERL_SECTIONS = ("data", "actor_rollout_ref", "algorithm", "trainer", "critic", "reward_model", "reward_manager",
                 "custom_reward_function", "ray_init", "ray_kwargs", "global_profiler", "model_engine",
                 "transfer_queue", "reward", "hydra")

KL_ALIASES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "low_var_kl", "k3": "k3"}
ADV_ALIASES = {"grpo": "grpo", "rloo": "rloo", "reinforce_plus_plus": "reinforce_pp",
               "reinforce_plus_plus_baseline": "reinforce_pp_baseline"}
TRACKERS = {"wandb": "wandb", "mlflow": "mlflow", "tensorboard": "tensorboard"}


def lookup(key: str):
    """("mapped", (target, meaning)), ("no_effect", why), ("unmapped", why) or ("unknown", why) for a verl key."""
    if key in MAPPED:
        return "mapped", MAPPED[key]
    for prefix in sorted(MAPPED, key=len, reverse=True):  # engine_kwargs.vllm.X -> engine_kwargs.vllm
        if key.startswith(prefix + "."):
            return "mapped", MAPPED[prefix]
    for prefix, why in sorted(NO_EFFECT.items(), key=lambda kv: -len(kv[0])):
        if key == prefix or key.startswith(prefix + "."):
            return "no_effect", why
    for prefix, why in sorted(UNMAPPED.items(), key=lambda kv: -len(kv[0])):
        if key.startswith(prefix) or key == prefix.rstrip("."):
            return "unmapped", why
    if key.split(".")[0] in VERL_SECTIONS:
        return "unmapped", "no equivalent here (not in scripts/verl_table.py)"
    return "unknown", f"not a verl key: its first part must be one of {', '.join(VERL_SECTIONS)}"


# ----------------------------------------------------------------------------- values


class BadInput(Exception):
    """A one-paragraph reason the input cannot be converted (exit 2)."""


def parse_value(text: str):
    """A Hydra override value as Python: bool, null, int, float, list/dict (flow syntax), or str."""
    import yaml

    t = text.strip()
    if not t:
        return ""
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        return t[1:-1]
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    if t.lower() in ("null", "none", "~"):
        return None
    for cast in (int, float):
        try:
            return cast(t)
        except ValueError:
            pass
    if t[:1] in "[{":
        try:
            value = yaml.safe_load(t)
        except yaml.YAMLError as e:
            raise BadInput(f"the value {t!r} is not a valid list or mapping ({e.problem})") from e
        return _numbers(value)
    return t


def _numbers(value):
    """yaml reads 1e-6 as a string; Hydra reads it as a float."""
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    if isinstance(value, str):
        try:
            return float(value) if any(c in value.lower() for c in ".e") else value
        except ValueError:
            return value
    return value


def count_rows(files) -> int | None:
    """Rows of the training files (JSONL lines, Parquet rows via pyarrow), or None when any is unreadable."""
    files = [files] if isinstance(files, str) else list(files or [])
    total = 0
    for path in files:
        try:
            if path.endswith(".parquet"):
                import pyarrow.parquet as pq

                total += pq.read_metadata(path).num_rows
            else:
                with open(path) as f:
                    total += sum(1 for line in f if line.strip())
        except (OSError, ImportError, ValueError):
            return None
    return total if files else None


def fmt(value) -> str:
    """A YAML flow value (floats always with a '.', so every YAML loader reads them as floats)."""
    if isinstance(value, float):
        text = repr(value)
        return text if "." in text or "inf" in text or "nan" in text else text.replace("e", ".0e", 1)
    if isinstance(value, (list, tuple, dict)):
        return "{" + ", ".join(f"{k}: {fmt(v)}" for k, v in value.items()) + "}" if isinstance(value, dict) \
            else "[" + ", ".join(fmt(v) for v in value) + "]"
    return json.dumps(value)
