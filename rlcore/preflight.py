"""Everything checked before any model loads, on every rank: the config against the world size,
files, the checkpoint to resume, the tokenizer and every data row. A mistake exits with code 2."""

from __future__ import annotations

import os

from rlcore import checkpoint, rewards
from rlcore.config import Config, ConfigError, fail, validate_against_world
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

