"""Everything checked before any model loads, on every rank: the config against the world size,
files, the checkpoint to resume, the tokenizer and every data row. A mistake exits with code 2."""

from __future__ import annotations

import json
import os

from rlcore import checkpoint, rewards
from rlcore.config import Config, ConfigError, check, fail
from rlcore.data import load_prompts


def preflight(cfg: Config, rank: int, world_size: int):
    """Every check that needs no model, on every rank: config against the world size, files, the
    checkpoint to resume, the tokenizer, every data row. A mistake exits with code 2 here."""
    try:
        validate_against_world(cfg, world_size)
        resume_from = checkpoint.find_resume(cfg.trainer.output_dir, cfg.checkpoint.resume)
        if resume_from is not None:
            checkpoint.validate_resume(resume_from, rank, world_size)
        tokenizer = load_tokenizer(cfg.model.path)
        prompts, stats = load_prompts(cfg.data.train_files, cfg.data, tokenizer)
    except ConfigError as e:
        fail(str(e))
    if rank == 0:
        print(f"train data: {stats['data/prompts']} prompts ({stats['data/bad_rows']} bad rows skipped, "
              f"{stats['data/filtered_too_long']} over data.max_prompt_length filtered)", flush=True)
    return tokenizer, prompts, resume_from


def prepare_scoring(cfg: Config, tokenizer, rank: int):
    """The reward scorer and the tokenized validation prompts (None without data.val_files)."""
    try:
        scorer = rewards.Scorer(cfg.reward)
        val_prompts = load_prompts(cfg.data.val_files, cfg.data, tokenizer)[0] if cfg.data.val_files else None
    except (ConfigError, ValueError) as e:
        fail(str(e))
    if rank == 0 and val_prompts:
        print(f"validation data: {len(val_prompts)} prompts", flush=True)
    return scorer, val_prompts


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    fix = "the folder needs the model's tokenizer files (tokenizer.json and tokenizer_config.json)"
    # transformers 5 builds an empty tokenizer (vocabulary of 1) from a folder without these files.
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ConfigError(f"model.path={path!r} is invalid: no tokenizer there; {fix}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"model.path={path!r} is invalid: no tokenizer loads from it ({type(e).__name__}); {fix}") from e
    if len(tokenizer) < 2:
        raise ConfigError(f"model.path={path!r} is invalid: its tokenizer has an empty vocabulary; {fix}")
    return tokenizer


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
    _check_experts(cfg, world_size)
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


def _check_experts(cfg: Config, world_size: int) -> None:
    from rlcore.config import model_num_experts

    ep, experts = cfg.parallel.ep_size, model_num_experts(cfg.model.path)
    check(world_size % ep == 0, "parallel.ep_size", ep, f"it must divide the world size {world_size}")
    if ep > 1:
        check(experts > 0, "parallel.ep_size", ep, "the model at model.path has no experts (a dense model): use 1")
        fits = [str(d) for d in range(2, experts + 1) if experts % d == 0 and world_size % d == 0]
        check(experts % ep == 0, "parallel.ep_size", ep,
              f"it must divide the model's {experts} experts (e.g. {', '.join(fits) or 1})")


def _model_context(model_path: str) -> int | None:
    """max_position_embeddings of the model's config.json (None when it does not say)."""
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
