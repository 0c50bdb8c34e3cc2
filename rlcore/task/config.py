"""The ``data`` config section: where the prompts come from and how each row becomes one.

It lives with the wing that reads it (``rlcore.task.prompts``); ``rlcore.config`` re-exports it. As
every section: ``__post_init__`` only checks, and a failed check names the key, the value and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from rlcore.errors import check, check_positive

CUTTING_MODES = ("left", "right", "middle")  # data.truncation values that cut a prompt to max_prompt_length


@dataclass
class DataConfig:
    """Prompts from local JSONL or Parquet files."""

    train_files: list[str] = field(default_factory=list)
    """JSONL or Parquet files of training prompts."""
    val_files: list[str] = field(default_factory=list)
    """Validation files (needed when trainer.val_every or trainer.val_before_train is on)."""
    prompt_key: str = "prompt"
    """Row key of the prompt (dotted for nested keys, e.g. extra.question)."""
    answer_key: Optional[str] = None
    """Row key of the reference answer the reward compares with (dotted for nested keys). null =
    answer, or reward_model.ground_truth when the training files hold verl's rows (data_source,
    prompt as chat messages, reward_model.ground_truth: docs/real_data.md)."""
    image_key: Optional[str] = None
    """Row key of the prompt's images, for a vision-language model: a list of paths (relative to the
    data file), bytes, or {bytes, path} dicts (the Parquet layout of public image sets); each
    goes where an <image> placeholder is in the prompt text. null = text-only prompts, or images
    when the training files hold verl's rows with images."""
    apply_chat_template: Optional[bool] = None
    """Render each prompt with the tokenizer's chat template (text as one user turn). null = false,
    or true when the training files hold verl's rows (verl always applies it)."""
    system_prompt: Optional[str] = None
    """System turn placed before each prompt (with apply_chat_template)."""
    max_prompt_length: int = 256
    """Prompt tokens at most."""
    truncation: Literal["filter", "error", "left", "right", "middle"] = "filter"
    """Prompts over max_prompt_length (counted in tokens after the chat template): filter (drop and
    count them), error (exit 2 at the row), or cut them to max_prompt_length tokens and count them,
    as verl's data.truncation does: left keeps the last max_prompt_length tokens, right the first,
    middle the first max_prompt_length // 2 and the last max_prompt_length - max_prompt_length // 2.
    A cut applies to the token ids (a chat template's header or generation prompt may be cut too);
    left/right/middle are refused with data.image_key (a cut could split an image's tokens)."""
    skip_bad_rows: bool = False
    """Skip (and count) malformed rows instead of stopping at the first with file:line."""
    shuffle: bool = True
    """Shuffle the prompts every epoch."""
    seed: int = 0
    """Seed of the shuffle."""

    def __post_init__(self):
        check_positive("data", self, "max_prompt_length")
        check(self.truncation not in CUTTING_MODES or not self.image_key, "data.truncation", self.truncation,
              f"with data.image_key={self.image_key!r} a cut could remove image placeholder tokens (each image's "
              f"tokens must stay whole); set data.truncation: filter (drop over-long prompts), or error")
