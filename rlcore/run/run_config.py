"""A checkpoint's run config: each checkpoint stores the run's resolved config (run_config.json), and a
resume compares it with this run's in the keys that change what is trained.

What counts: the model, the data, the rollout's sampling, the algorithm, rollout correction,
exploration, the optimizer, the reward, LoRA, distillation, tools and environment, and the trainer's
seed and prompts per step. Not: the length of the run (trainer.total_steps, total_epochs), paths
where the run writes (trainer.output_dir), checkpoints, logging, validation (val.*, data.val_files,
trainer.val_*), the layout and memory of the engines (parallel.*, offload.*, vLLM's sizes and
kernels, micro-batch sizes, which leave the update the same), the watchdogs.

checkpoint.resume=auto refuses a checkpoint that differs (ConfigError: exit 2, naming each key and
both values) unless checkpoint.resume_config_mismatch=accept; a checkpoint named by path is resumed
as named and its differences are said. A checkpoint without run_config.json (written before runs
stored it) is resumed with a warning.
"""

from __future__ import annotations

import dataclasses
import json
import os

from rlcore.config import Config, ConfigError

FILE = "run_config.json"
# Sections that never change what is trained.
UNTRAINED_SECTIONS = ("val", "parallel", "offload", "checkpoint", "logging")
# Keys of the other sections that do not either: length, paths, validation, watchdogs, engine layout,
# memory and kernels, micro-batching (the update is the same), the sync check.
UNTRAINED_KEYS = {
    "trainer": ("total_steps", "total_epochs", "output_dir", "val_every", "val_before_train", "preempt_grace_s",
                "max_consecutive_skips", "watchdog_s", "balance_batch"),
    "data": ("val_files", "skip_bad_rows"),
    "model": ("gradient_checkpointing", "attn_implementation", "moe_implementation", "trust_remote_code"),
    "rollout": ("tensor_parallel_size", "max_model_len", "kv_cache_gb", "gpu_memory_utilization", "sleep_level",
                "free_kv_cache", "emulate_sleep", "emulate_ascend_moe", "sync_bucket_mb", "weight_load",
                "enforce_eager", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching",
                "enable_chunked_prefill", "enable_expert_parallel", "engine_kwargs", "block_size",
                "limit_mm_per_prompt", "check_sync", "check_sync_tol", "check_sync_every"),
    "algorithm": ("micro_batch_size", "micro_batch_tokens", "log_prob_micro_batch_size", "log_prob_micro_batch_tokens",
                  "share_prompt", "response_only_logits"),
    "reward": ("timeout_s",),
    "distill": ("kv_cache_gb", "gpu_memory_utilization", "sleep_level", "max_model_len"),
}
ACCEPT = "accept"  # checkpoint.resume_config_mismatch


def files(cfg: Config) -> dict[str, dict]:
    """What a checkpoint stores of the run's config (rlcore.run.checkpoint.write's ``files``)."""
    return {FILE: {"version": 1, "config": plain(cfg)}}


def plain(cfg: Config) -> dict:
    """The config as JSON data (tuples as lists, anything else as its text)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def training_keys(config: dict) -> dict:
    """Dotted key -> value of the keys that change what is trained."""
    out = {}
    for section, value in config.items():
        if section in UNTRAINED_SECTIONS:
            continue
        if not isinstance(value, dict):  # tools: a list
            out[section] = value
            continue
        skip = UNTRAINED_KEYS.get(section, ())
        for key, v in value.items():
            if key not in skip:
                out[f"{section}.{key}"] = v
    return out


def differences(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """(key, saved value, current value) of the training keys that differ; keys one of the two
    configs does not have (written by another version of this trainer) are not compared."""
    a, b = training_keys(saved), training_keys(current)
    return [(k, a[k], b[k]) for k in sorted(a.keys() & b.keys()) if a[k] != b[k]]


def read(path: str) -> dict | None:
    """The config stored in checkpoint ``path``, or None when it stores none."""
    try:
        with open(os.path.join(path, FILE)) as f:
            return json.load(f)["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_resume(path: str, cfg: Config) -> str | None:
    """Before any model loads: ``path`` (the checkpoint checkpoint.resume found) against this run's
    config. Returns the start-up note, if any; ConfigError for a differing checkpoint that
    checkpoint.resume=auto found, unless checkpoint.resume_config_mismatch=accept."""
    saved = read(path)
    if saved is None:
        return (f"warning: checkpoint.resume: {path} stores no {FILE} (written before checkpoints stored their run's "
                f"config): resuming it without checking that this run is configured as that one was")
    diff = differences(saved, plain(cfg))
    if not diff:
        return None
    listed = "; ".join(f"{k}: {_show(old)} there, {_show(new)} now" for k, old, new in diff)
    c = cfg.checkpoint
    if c.resume != "auto":
        return f"checkpoint.resume: {path} was written by a run configured differently ({listed}); resuming it as named"
    if c.resume_config_mismatch == ACCEPT:
        return (f"checkpoint.resume: resuming {path}, written by a run configured differently ({listed}), as "
                f"checkpoint.resume_config_mismatch=accept says")
    raise ConfigError(
        f"checkpoint.resume=auto found {path} in trainer.output_dir={cfg.trainer.output_dir!r}, but that run was "
        f"configured differently in {len(diff)} key(s) that change what is trained: {listed}. A run directory holds "
        f"one run: give this run its own trainer.output_dir (null = outputs/<config file name>), or set "
        f"checkpoint.resume_config_mismatch: accept to continue that run with this config on purpose")


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 120 else text[:117] + "..."
