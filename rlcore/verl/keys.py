"""verl's keys and what they become here, in three classes (docs/from_verl.md lists them;
tests/test_from_verl.py checks that the doc and these tables name the same keys):

    MAPPED     verl key -> (this project's key, meaning here): copied with its verl origin. Keys whose
               conversion is more than a copy are converted by rlcore/verl/rules_*.py (RULES there)
    NO_EFFECT  verl keys with no effect on what is trained here: Ray, profilers, kernels, memory and
               speed knobs this trainer decides itself, verl's no-ops; written as a comment with why
    UNMAPPED   verl keys (prefixes) that change training and have no equivalent here: exit 2 unless
               --allow-unmapped, then listed in the YAML's header as what the run does NOT do

Defaults and meanings checked against verl-project/verl 1dda039 (verl/trainer/config/_generated_*.yaml,
copied in rlcore/verl/defaults/; verl/trainer/ppo/core_algos.py; verl/workers/config/*.py).
"""

from __future__ import annotations

A = "actor_rollout_ref.actor."
R = "actor_rollout_ref.rollout."
REF = "actor_rollout_ref.ref."
M = "actor_rollout_ref.model."
MG = A + "megatron.override_transformer_config."

MAPPED: dict[str, tuple[str, str]] = {
    # data
    "data.train_files": ("data.train_files", "JSONL or Parquet files; verl's one path or list becomes a list"),
    "data.val_files": ("data.val_files", "validation files"),
    "data.shuffle": ("data.shuffle", "shuffle every epoch"),
    "data.seed": ("data.seed", "seed of the shuffle (verl's null: 0 here)"),
    # model
    M + "path": ("model.path", "local HF folder (nothing is downloaded: a hub name must become a local path)"),
    M + "enable_gradient_checkpointing": ("model.gradient_checkpointing", "recompute each layer in backward; verl's default true is written when unset"),
    M + "target_modules": ("lora.target_modules", "LoRA target modules"),
    M + "lora_adapter_path": ("lora.path", "start from a PEFT adapter"),
    M + "lora.adapter_path": ("lora.path", "start from a PEFT adapter"),
    # actor
    A + "optim.lr": ("optim.lr", "peak learning rate"),
    A + "optim.weight_decay": ("optim.weight_decay", "AdamW weight decay; verl's default 0.01 is written when unset (0.0 here)"),
    A + "optim.betas": ("optim.betas", "AdamW betas"),
    A + "optim.clip_grad": ("optim.grad_clip", "max global gradient norm"),
    A + "optim.grad_clip": ("optim.grad_clip", "verl's deprecated name of optim.clip_grad (it overrides clip_grad)"),
    A + "optim.min_lr_ratio": ("optim.min_lr_ratio", "cosine floor as a fraction of lr"),
    A + "ppo_epochs": ("algorithm.ppo_epochs", "passes over each step's samples"),
    A + "ppo_micro_batch_size_per_gpu": ("algorithm.micro_batch_size", "sequences per forward/backward on each rank"),
    A + "entropy_coeff": ("algorithm.entropy_coef", "entropy bonus weight"),
    A + "clip_ratio_low": ("algorithm.clip_low", "PPO clip below 1 (a divergence bound for dppo_*)"),
    A + "clip_ratio_high": ("algorithm.clip_high", "PPO clip above 1 (a divergence bound for dppo_*)"),
    A + "clip_ratio_c": ("algorithm.dual_clip_c", "dual-clip bound (the ratio's cap for dppo_*)"),
    A + "tau_pos": ("algorithm.sapo_tau_pos", "SAPO's gate temperature for A > 0"),
    A + "tau_neg": ("algorithm.sapo_tau_neg", "SAPO's gate temperature for A <= 0"),
    A + "ulysses_sequence_parallel_size": ("parallel.ulysses_size", "Ulysses group size"),
    A + "fsdp_config.ulysses_sequence_parallel_size": ("parallel.ulysses_size", "Ulysses group size"),
    A + "veomni.ulysses_parallel_size": ("parallel.ulysses_size", "Ulysses group size"),
    A + "fsdp_config.param_offload": ("offload.params", "offload parameter shards while generating"),
    A + "fsdp_config.optimizer_offload": ("offload.optimizer", "offload optimizer state while generating"),
    A + "veomni.param_offload": ("offload.params", "offload parameter shards while generating"),
    A + "veomni.optimizer_offload": ("offload.optimizer", "offload optimizer state while generating"),
    A + "megatron.param_offload": ("offload.params", "offload parameter shards while generating"),
    A + "megatron.optimizer_offload": ("offload.optimizer", "offload optimizer state while generating"),
    A + "veomni.expert_parallel_size": ("parallel.ep_size", "expert parallelism of the trainer"),
    A + "megatron.expert_model_parallel_size": ("parallel.ep_size", "expert parallelism of the trainer"),
    A + "freeze_vision_tower": ("model.freeze_vision_tower", "train the language model only"),
    # reference
    REF + "fsdp_config.param_offload": ("offload.ref", "reference policy on the host outside its forward"),
    REF + "veomni.param_offload": ("offload.ref", "reference policy on the host outside its forward"),
    REF + "megatron.param_offload": ("offload.ref", "reference policy on the host outside its forward"),
    # rollout
    R + "n": ("rollout.n", "samples per prompt; verl's default 1 is written when unset"),
    R + "temperature": ("rollout.temperature", "sampling temperature"),
    R + "top_p": ("rollout.top_p", "nucleus sampling"),
    R + "top_k": ("rollout.top_k", "top-k sampling (-1 off)"),
    R + "tensor_model_parallel_size": ("rollout.tensor_parallel_size", "vLLM TP size; verl's default 2 is written when unset"),
    R + "gpu_memory_utilization": ("rollout.gpu_memory_utilization", "vLLM's share of device memory"),
    R + "enforce_eager": ("rollout.enforce_eager", "no CUDA graphs (verl's false: null here resolves to false on cuda/npu)"),
    R + "free_cache_engine": ("rollout.free_kv_cache", "release vLLM's memory while training"),
    R + "max_num_batched_tokens": ("rollout.max_num_batched_tokens", "vLLM's token budget per scheduler step; verl's 8192 is written when unset"),
    R + "max_num_seqs": ("rollout.max_num_seqs", "vLLM's concurrent sequences; verl's 256 is written when unset"),
    R + "enable_prefix_caching": ("rollout.enable_prefix_caching", "share prompt KV blocks (verl's true: null here keeps vLLM's, on)"),
    R + "enable_chunked_prefill": ("rollout.enable_chunked_prefill", "vLLM's chunked prefill (verl's true: null here resolves to on for cuda/npu)"),
    R + "checkpoint_engine.update_weights_bucket_megabytes": ("rollout.sync_bucket_mb", "weight-sync bucket in MiB; verl's 2048 is written when unset"),
    # algorithm
    "algorithm.norm_adv_by_std_in_grpo": ("algorithm.norm_by_std", "False = Dr.GRPO"),
    "algorithm.gamma": ("algorithm.gamma", "reinforce_pp discount"),
    # trainer
    "trainer.max_actor_ckpt_to_keep": ("checkpoint.keep_last", "complete checkpoints kept (verl's null: every one)"),
    "trainer.log_val_generations": ("val.num_examples", "validation generations written per validation"),
    "actor_rollout_ref.nccl_timeout": ("parallel.timeout_s", "process-group timeout in seconds"),
}

# Keys converted by a rule (rlcore/verl/rules_*.py): the doc's table says what each does.
RULE_KEYS: dict[str, tuple[str, str]] = {}  # filled by rlcore.verl.rules.rule()

NO_EFFECT: dict[str, str] = {
    # data and model loading
    M + "use_remove_padding": "sequences are always packed without padding here",
    M + "use_fused_kernels": "the LM head projects response tokens only here (algorithm.response_only_logits)",
    M + "fused_kernel_options": "the LM head projects response tokens only here",
    M + "use_shm": "models load from a local path",
    M + "use_liger": "kernels are chosen by model.attn_implementation / moe_implementation here",
    M + "enable_activation_offload": "a memory knob: activation memory here is model.gradient_checkpointing's",
    M + "tiled_mlp": "a memory knob this trainer does not need (packed micro-batches, algorithm.micro_batch_tokens)",
    M + "lora.lora_A_init_method": "PEFT initialises LoRA A (kaiming-uniform) and B (zeros) here, the standard LoRA start",
    M + "lora.lora_B_init_method": "PEFT initialises LoRA B to zeros here, as verl",
    M + "lora.merge": "how verl hands LoRA weights to vLLM; vLLM runs the adapter here, the trained weights are the same",
    "data.return_raw_chat": "prompts are rendered here (data.apply_chat_template)",
    "data.return_raw_input_ids": "prompts are tokenized here",
    "data.return_full_prompt": "prompts are rendered here",
    "data.return_multi_modal_inputs": "the image processor runs in the trainer here",
    "data.dataloader_num_workers": "prompts are read in the trainer's process",
    "data.filter_overlong_prompts_workers": "prompts are read in the trainer's process",
    "data.use_shm": "files are read from a local path",
    "data.val_batch_size": "validation generates every validation prompt in one call",
    "data.validation_shuffle": "validation keeps the file's order here",
    "data.image_patch_size": "the model's image processor (preprocessor_config.json) sets the patch size here, as vLLM's",
    "data.reward_fn_key": "verl 1dda039's reward loop reads each row's data_source whatever it says (experimental/reward_loop/reward_manager/naive.py:42); only its legacy reward managers read it",
    # actor / reference engines: kernels, memory, layout
    REF + "strategy": "the reference is built as the actor",
    A + "use_torch_compile": "no torch.compile of the actor here",
    REF + "use_torch_compile": "no torch.compile here",
    A + "entropy_from_logits_with_chunking": "a memory knob: the entropy is computed on response tokens only here",
    A + "entropy_from_logits_chunk_size": "a memory knob: the entropy is computed on response tokens only here",
    A + "entropy_checkpointing": "a memory knob: the entropy is computed on response tokens only here",
    REF + "entropy_from_logits_with_chunking": "the reference computes no entropy here",
    REF + "entropy_from_logits_chunk_size": "the reference computes no entropy here",
    REF + "entropy_checkpointing": "the reference computes no entropy here",
    A + "pad_to_length": "a kernel knob (static shapes): micro-batches are packed here",
    REF + "pad_to_length": "a kernel knob (static shapes): micro-batches are packed here",
    A + "calculate_entropy": "actor/entropy is always logged here",
    A + "calculate_sum_pi_squared": "feeds verl's optimal_token_baseline estimator only",
    A + "grad_clip": "verl 1dda039 reads it nowhere: its engines clip with optim.clip_grad (workers/engine/fsdp/transformer_impl.py:771-787)",
    A + "checkpoint": "which parts verl saves and loads: checkpoints here hold the whole state",
    A + "shuffle": "verl's mini-batch shuffle is off by default; mini-batches here keep the step's order",
    A + "data_loader_seed": "the step's order comes from data.seed here",
    A + "fsdp_config.reshard_after_forward": "FSDP2 reshards after forward here (VeOmni's default)",
    A + "fsdp_config.forward_prefetch": "a speed knob of FSDP's prefetch",
    A + "fsdp_config.offload_policy": "a memory knob (FSDP2's CPU offload while training); offload.* decide here",
    A + "fsdp_config.use_orig_params": "an FSDP1 wrapping detail; FSDP2 here",
    A + "fsdp_config.model_dtype": "precision: master weights and optimizer state are float32 here, compute in model.dtype",
    A + "fsdp_config.mixed_precision": "precision: float32 master weights, bf16 compute on cuda/npu (model.dtype), float32 gradient reduction",
    A + "fsdp_config.dtype": "precision: model.dtype (bf16 compute on cuda/npu)",
    A + "fsdp_config.wrap_policy": "FSDP2 wraps each decoder layer here (VeOmni)",
    A + "fsdp_config.entropy_from_logits_with_chunking": "a memory knob",
    A + "fsdp_config.entropy_checkpointing": "a memory knob",
    A + "fsdp_config.use_torch_compile": "no torch.compile here",
    A + "fsdp_config.turbo_config": "fsdp_turbo's sharding and recompute plans: VeOmni's FSDP2 shards here (parallel.*, model.gradient_checkpointing)",
    A + "fsdp_config.seed": "initialisation seed of FSDP's meta-device build: weights load from model.path",
    A + "fsdp_config.forward_only": "an engine flag of verl's worker",
    A + "fsdp_config.pad_to_length_bucket": "a kernel knob (static shapes)",
    REF + "fsdp_config": "the reference's FSDP settings: it is built as the actor here (offload.ref for its memory)",
    REF + "ulysses_sequence_parallel_size": "the reference forward uses parallel.ulysses_size",
    REF + "veomni": "the reference is built as the actor here (offload.ref for its memory)",
    REF + "megatron": "the reference is built as the actor here (offload.ref for its memory)",
    REF + "router_replay": "the reference forward routes as it likes (verl's default disabled)",
    REF + "rollout_n": "the rollout's n",
    A + "rollout_n": "the rollout's n",
    A + "veomni.moe_implementation": "a kernel choice: model.moe_implementation auto takes VeOmni's fused kernel on cuda/npu",
    A + "veomni.enable_full_shard": "True only (False: unmapped): FSDP2 shards fully here (parallel.fsdp_size for HSDP)",
    A + "veomni.cross_entropy_loss_implementation": "a kernel choice: log-probs come from the response tokens' logits here",
    A + "veomni.dsa_indexer_implementation": "a kernel choice of VeOmni's DeepSeek sparse attention",
    A + "veomni.dsa_attention_implementation": "a kernel choice of VeOmni's DeepSeek sparse attention",
    A + "veomni.mhc_implementation": "a kernel choice of VeOmni's manifold hyper-connections",
    A + "veomni.enable_fsdp_offload": "a memory knob (FSDP2's CPU offload while training); offload.* decide here",
    A + "veomni.rms_norm_implementation": "a kernel choice (VeOmni's, picked per device here)",
    A + "veomni.swiglu_mlp_implementation": "a kernel choice (VeOmni's, picked per device here)",
    A + "veomni.rotary_pos_emb_implementation": "a kernel choice (VeOmni's, picked per device here)",
    A + "veomni.init_device": "VeOmni builds on the meta device here",
    A + "veomni.forward_prefetch": "a speed knob of FSDP's prefetch",
    A + "megatron.tensor_model_parallel_size": "Megatron's layout: VeOmni's FSDP2 shards the model here (parallel.*)",
    A + "megatron.pipeline_model_parallel_size": "Megatron's layout: VeOmni's FSDP2 shards the model here",
    A + "megatron.virtual_pipeline_model_parallel_size": "Megatron's layout: VeOmni's FSDP2 shards the model here",
    A + "megatron.context_parallel_size": "Megatron's layout: parallel.ulysses_size splits long sequences here",
    A + "megatron.expert_tensor_parallel_size": "Megatron's layout: VeOmni's FSDP2 shards the model here",
    A + "megatron.sequence_parallel": "Megatron's layout: VeOmni's FSDP2 shards the model here",
    A + "megatron.use_megatron_fsdp": "Megatron's layout: VeOmni's FSDP2 shards the model here",
    A + "megatron.use_mbridge": "how verl converts HF weights for Megatron: HF weights load directly here",
    A + "megatron.vanilla_mbridge": "how verl converts HF weights for Megatron: HF weights load directly here",
    A + "megatron.use_dist_checkpointing": "Megatron's checkpoint format: HF weights load directly here",
    A + "megatron.dist_checkpointing_path": "Megatron's checkpoint format: HF weights load directly here",
    A + "megatron.use_remove_padding": "sequences are always packed without padding here",
    A + "megatron.grad_offload": "a memory knob: offload.* decide here",
    A + "megatron.dtype": "precision: model.dtype (bf16 compute on cuda/npu)",
    A + "megatron.override_transformer_config": "Megatron's kernels, fusions, recompute and pipeline layout: VeOmni's kernels and model.gradient_checkpointing here",
    A + "engine": "Megatron-Lite's layout and offload: VeOmni's FSDP2 here",
    A + "optim.override_optimizer_config.optimizer_cpu_offload": "a memory knob: offload.optimizer decides here",
    A + "optim.override_optimizer_config.optimizer_offload_fraction": "a memory knob: offload.optimizer decides here",
    A + "optim.override_optimizer_config.offload_fraction": "a memory knob: offload.optimizer decides here",
    A + "optim.override_optimizer_config.overlap_cpu_optimizer_d2h_h2d": "a speed knob of Megatron's CPU optimizer",
    A + "optim.override_optimizer_config.use_precision_aware_optimizer": "precision of Megatron's optimizer state: float32 here (optim.state_dtype)",
    A + "optim.optimizer_impl": "torch's AdamW here",
    A + "optim.total_training_steps": "set by verl from trainer.total_training_steps",
    A + "optim.num_cycles": "cosine's half cycle, as here",
    A + "optim.zero_indexed_step": "the schedule starts at step 0 here too",
    A + "profiler": "no profiler integration (a measuring tool, not a training setting)",
    REF + "profiler": "no profiler integration",
    R + "profiler": "no profiler integration",
    "global_profiler": "no profiler integration",
    # rollout
    R + "mode": "vLLM runs in-process here (sync and async alike)",
    R + "load_format": "weights are pushed from the trainer at every sync",
    R + "layered_summon": "the sync gathers in buckets (rollout.sync_bucket_mb)",
    R + "calculate_log_probs": "vLLM's log-probs are always kept (rollout_correction)",
    R + "data_parallel_size": "every TP group is one data-parallel engine: world size / tensor_parallel_size",
    R + "multi_stage_wake_up": "the switch order is fixed (rlcore/step/switch.py)",
    R + "disable_log_stats": "vLLM's periodic stats log is off here; rollout/* metrics report generation",
    R + "skip_tokenizer_init": "prompts are token ids here",
    R + "cudagraph_capture_sizes": "a speed knob: vLLM's default capture sizes (rollout.engine_kwargs for others)",
    R + "moe_tensor_parallel_size": "a layout knob of verl's SGLang/vLLM MoE: each engine here is one TP group",
    R + "nnodes": "every node runs its own engines here",
    R + "n_gpus_per_node": "the launcher's ranks per node",
    R + "seed": "generation seeds derive from trainer.seed here",
    R + "logprobs_mode": "vLLM's processed log-probs (temperature applied) are kept here, as verl's default",
    R + "scheduling_policy": "vLLM's first-come-first-served, as verl's default",
    R + "do_sample": "training samples (temperature, top_p, top_k)",
    R + "over_sample_rate": "0 (verl's default): no early-stopped generations",
    R + "trace": "no rollout tracing integration",
    R + "prometheus": "no Prometheus exporter",
    R + "agent.num_workers": "the agent loop runs in the trainer's process",
    R + "agent.default_agent_loop": "single_turn_agent only (another loop: unmapped): one generation per prompt",
    R + "ignore_eos": "False only (True: unmapped): generation stops at the end-of-sequence token",
    R + "engine_kwargs.sglang": "SGLang's arguments; vLLM is the engine here",
    R + "engine_kwargs.trtllm": "TensorRT-LLM's arguments; vLLM is the engine here",
    R + "pipeline_model_parallel_size": "1 only: one TP group per engine here",
    R + "moe_load_balance_metrics_interval": "no MoE load metrics from vLLM",
    R + "checkpoint_engine.backend": "the weight sync is in-process here",
    R + "checkpoint_engine.engine_kwargs": "the weight sync is in-process here",
    R + "checkpoint_engine.custom_backend_module": "the weight sync is in-process here",
    R + "disaggregation.enabled": "False only (True: unmapped)",
    R + "full_determinism": "False only (True: unmapped)",
    "actor_rollout_ref.hybrid_engine": "True only (False: unmapped): the policy and vLLM are always colocated",
    # algorithm, reward, trainer
    "algorithm.kl_ctrl": "read by verl only with use_kl_in_reward true",
    "algorithm.kl_penalty": "read by verl only with use_kl_in_reward true",
    "algorithm.lam": "GAE only (a critic)",
    "algorithm.gdpo_reward_keys": "read by verl's gdpo estimator only",
    "algorithm.use_pf_ppo": "False only (True: unmapped)",
    "algorithm.pf_ppo": "read by verl only with use_pf_ppo true",
    "algorithm.filter_groups.max_inflight_gen_batches": "a speed knob of verl's asynchronous DAPO rounds",
    "trainer.critic_warmup": "no critic (0 only)",
    "trainer.use_legacy_worker_impl": "no worker classes here",
    "trainer.use_v1": "verl's trainer implementation: the loop here is one program",
    "trainer.v1.trainer_mode": "sync only (another mode: unmapped): the loop here is synchronous",
    "trainer.v1.sync": "verl's synchronous trainer's settings",
    "trainer.rollout_data_dir": "verl dumps rollouts there; val.num_examples writes validation generations here",
    "trainer.validation_data_dir": "verl dumps validation generations there; val.num_examples writes them here",
    "trainer.max_critic_ckpt_to_keep": "no critic",
    "trainer.esi_redundant_time": "Ray's elastic training margin",
    "trainer.ray_wait_register_center_timeout": "no Ray here",
    "trainer.default_hdfs_dir": "checkpoints stay in trainer.output_dir",
    "trainer.del_local_ckpt_after_load": "checkpoints stay in trainer.output_dir",
    "trainer.val_only": "False only (True: unmapped)",
    "reward_model.use_reward_loop": "rewards are scored in the loop here",
    "reward_model.num_workers": "rewards are scored in the trainer's process",
    "reward.num_workers": "rewards are scored in the trainer's process",
    "reward_model.reward_kwargs.overlong_buffer_cfg.log": "overlong shaping is always logged (reward/overlong_penalty_mean)",
    "reward.reward_kwargs.overlong_buffer_cfg.log": "overlong shaping is always logged (reward/overlong_penalty_mean)",
    "reward_model.overlong_buffer.log": "overlong shaping is always logged (reward/overlong_penalty_mean)",
    "ray_kwargs": "no Ray here: torchrun starts every rank (its runtime_env, executables and workers do nothing)",
    "ray_init": "no Ray here: torchrun starts every rank",
    "transfer_queue": "no transfer queue: the colocated loop passes tensors in process",
    "hydra": "Hydra's own settings: this project reads one YAML config",
    "distillation.n_gpus_per_node": "the teacher runs in-process beside the policy on every rank here",
    "distillation.nnodes": "the teacher runs in-process beside the policy on every rank here",
}

# NO_EFFECT keys that have no effect only at these values (another value is UNMAPPED, with this reason)
NO_EFFECT_ONLY: dict[str, tuple[list, str]] = {
    "trainer.critic_warmup": ([0], "critic warm-up steps: no critic here"),
    REF + "strategy": (["fsdp", "fsdp2", "fsdp_turbo", "veomni", "dp"], "Megatron is not a backend here: VeOmni's FSDP2"),
    A + "veomni.enable_full_shard": ([True], "FSDP without full sharding: parallel.fsdp_size sets HSDP here"),
    "actor_rollout_ref.hybrid_engine": ([True], "a rollout separate from the trainer: the policy and vLLM are always colocated here"),
    "trainer.v1.trainer_mode": (["sync"], "verl's asynchronous trainers: the loop here is synchronous (rollout.partial for partial rollouts)"),
    "trainer.val_only": ([False], "a validation-only run: scripts/evaluate.py evaluates a model here"),
    "algorithm.use_pf_ppo": ([False], "PF-PPO's reweighting of the batch by reward"),
    R + "disaggregation.enabled": ([False], "prefill/decode disaggregation across engines"),
    R + "full_determinism": ([False], "vLLM's batch-invariant deterministic mode"),
    R + "pipeline_model_parallel_size": ([1], "vLLM pipeline parallelism: each engine here is one TP group"),
    R + "agent.default_agent_loop": (["single_turn_agent"], "verl's agent loops (tools, multi-turn): rollout.multi_turn "
                                    "and tools here (docs/tools.md)"),
    R + "ignore_eos": ([False], "generation past the end-of-sequence token"),
    R + "over_sample_rate": ([0, 0.0], "early-stopped generations (over-sampling) drop the slowest responses"),
    MG + "moe_aux_loss_coeff": ([0, 0.0], "a load-balancing loss on the router (none here)"),
    MG + "moe_z_loss_coeff": ([0, 0.0, None], "a z-loss on the router logits (none here)"),
    MG + "moe_router_load_balancing_type": (["none"], "a load-balancing loss on the router (none here)"),
    MG + "moe_router_enable_expert_bias": ([False], "router expert biases updated while training (aux-loss-free balancing)"),
    MG + "moe_router_bias_update_rate": ([0, 0.0], "router expert biases updated while training"),
    MG + "dsa_indexer_loss_coeff": ([0, 0.0], "DeepSeek sparse attention's indexer loss"),
    MG + "dsa_indexer_use_sparse_loss": ([False], "DeepSeek sparse attention's indexer loss"),
    MG + "fp8": ([None, False], "FP8 training (other numerics than bf16/fp32)"),
    MG + "fp8_recipe": ([None], "FP8 training (other numerics than bf16/fp32)"),
}

UNMAPPED: dict[str, str] = {
    "reward_model.": "verl's older reward-model worker settings (FSDP worker, micro-batches): reward.models runs reward models on the rollout engine here (docs/judges.md)",
    "reward.": "verl's reward settings: reward.components / reward.fn / reward.models here (docs/judges.md)",
    "custom_reward_function.": "not a key of verl's custom_reward_function (path, name, reward_kwargs)",
    "sandbox_fusion.": "no SandboxFusion client: tools run in rlcore's own sandbox (docs/tools.md)",
    R + "multi_turn.": "multi-turn is configured with rollout.multi_turn and tools here (docs/tools.md)",
    R + "agent.": "verl's agent loops: rollout.multi_turn and tools here (docs/tools.md)",
    R + "quantization": "quantized rollout weights",
    R + "mtp": "multi-token prediction (speculative decoding) in the rollout",
    R + "val_kwargs.top_k": "validation top-k sampling: validation samples with val.temperature and val.top_p only",
    "data.custom_cls.": "no custom dataset class: JSONL or Parquet rows (data.prompt_key, data.answer_key)",
    "data.mm_processor_kwargs.": "no image-processor arguments",
    "data.tokenizer": "the tokenizer is the model's",
    "data.train_max_samples": "no cap on the training prompts (cut the file)",
    "data.min_response_length": "no minimum response length",
    "data.tool_config_path": "tools are configured with rollout.multi_turn and tools here (docs/tools.md)",
    "data.video_key": "videos in the prompt rows",
    "data.audio_key": "audio in the prompt rows",
    M + "lora.": "verl's Megatron LoRA settings (lora_rank/lora_alpha are the FSDP ones)",
    M + "mtp.": "multi-token prediction (an extra loss and speculative decoding)",
    M + "custom_chat_template": "the tokenizer's own chat template is applied",
    M + "external_lib": "no extra model library import",
    M + "hf_config_path": "config.json is read from model.path",
    M + "tokenizer_path": "the tokenizer is read from model.path",
    A + "megatron.": "Megatron is not a backend here",
    A + "optim.override_optimizer_config.": "no free-form optimizer arguments",
    A + "optim.lr_decay_steps": "a decay shorter than the run (Megatron's schedule)",
    A + "policy_loss.": "another of verl's policy-loss settings",
    A + "router_replay.": "verl's routing replay files",
    A + "loss_scale_factor": "a constant loss scale (seq-mean-token-sum-norm's divisor here is the response budget)",
    A + "use_rollout_log_probs": "vLLM's log-probs as the old policy: algorithm.use_rollout_logprobs here, for one PPO epoch and mini-batch",
    A + "veomni.": "VeOmni's other engine settings are set by this trainer",
    "algorithm.rollout_correction.": "not a key of verl 1dda039's rollout_correction (rollout_is, rollout_is_threshold, rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold, bypass_mode, loss_type): an older verl's setting (verl 1dda039 refuses it too)",
    "distillation.": "verl's other distillation settings",
    "async_training.": "verl's fully asynchronous trainer",
    "rollout.": "verl's fully asynchronous trainer's rollout section",
    "trainer.v1.": "verl's asynchronous trainers",
}

# verl's top-level config sections: a key outside them is not a verl key (an error, not "unmapped").
VERL_SECTIONS = ("data", "actor_rollout_ref", "algorithm", "trainer", "critic", "reward_model", "reward_manager",
                 "custom_reward_function", "ray_init", "ray_kwargs", "global_profiler", "model_engine",
                 "transfer_queue", "reward", "hydra", "distillation", "sandbox_fusion", "async_training", "rollout")


def _prefixed(table: dict, key: str):
    """The entry of the longest prefix in ``table`` that names ``key`` or a section above it."""
    for prefix in sorted(table, key=len, reverse=True):
        bare = prefix.rstrip(".")
        if key == bare or key.startswith(bare + "."):
            return table[prefix]
    return None


def lookup(key: str):
    """("rule", ...), ("mapped", (target, meaning)), ("no_effect", why), ("unmapped", why) or
    ("unknown", why) for a verl key (the longest matching entry wins)."""
    if key in RULE_KEYS:
        return "rule", RULE_KEYS[key]
    for prefix in (k for k in RULE_KEYS if k.endswith(".*")):
        if key.startswith(prefix[:-1]):
            return "rule", RULE_KEYS[prefix]
    if key in MAPPED:
        return "mapped", MAPPED[key]
    why = _prefixed(NO_EFFECT, key)
    if why is not None:
        return "no_effect", why
    why = _prefixed(UNMAPPED, key)
    if why:
        return "unmapped", why
    if key.split(".")[0] in VERL_SECTIONS:
        return "unmapped", "no equivalent here (not in rlcore/verl/keys.py)"
    return "unknown", f"not a verl key: its first part must be one of {', '.join(VERL_SECTIONS)}"
