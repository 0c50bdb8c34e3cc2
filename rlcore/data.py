"""Prompt data: local JSONL files -> tokenized prompts, a seeded shuffle per epoch, and a position
(epoch, index) that a checkpoint can store. Every rank builds the same order and takes its slice.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from rlcore.config import ConfigError, DataConfig


@dataclass
class Prompt:
    ids: list[int]  # prompt token ids
    text: str
    answer: str


def read_rows(path: str, cfg: DataConfig) -> tuple[list[dict], int]:
    """Rows of a JSONL file with both keys present; (rows, bad_row_count)."""
    rows, bad = [], 0
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            problem = None
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    problem = "is not a JSON object"
                else:
                    missing = [k for k in (cfg.prompt_key, cfg.answer_key) if k not in row]
                    problem = f"lacks key(s) {missing}" if missing else None
            except json.JSONDecodeError as e:
                problem = f"is not valid JSON ({e.msg})"
            if problem is None:
                rows.append(row)
            elif cfg.skip_bad_rows:
                bad += 1
            else:
                raise ConfigError(
                    f"{path}:{lineno} {problem}; fix the row, or set data.skip_bad_rows=true to skip such rows"
                )
    return rows, bad


def render_prompt(row: dict, cfg: DataConfig, tokenizer) -> str:
    prompt = row[cfg.prompt_key]
    if not cfg.apply_chat_template:
        return prompt if isinstance(prompt, str) else str(prompt)
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
    if cfg.system_prompt:
        messages = [{"role": "system", "content": cfg.system_prompt}] + messages
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def load_prompts(files: list[str], cfg: DataConfig, tokenizer) -> tuple[list[Prompt], dict]:
    """Tokenize every row; filter or reject over-long prompts. Returns (prompts, data/* stats)."""
    prompts, bad, too_long = [], 0, 0
    for path in files:
        rows, nbad = read_rows(path, cfg)
        bad += nbad
        for row in rows:
            text = render_prompt(row, cfg, tokenizer)
            ids = tokenizer(text, add_special_tokens=not cfg.apply_chat_template)["input_ids"]
            if len(ids) > cfg.max_prompt_length:
                if cfg.truncation == "error":
                    raise ConfigError(
                        f"a prompt in {path} has {len(ids)} tokens > data.max_prompt_length="
                        f"{cfg.max_prompt_length}; raise the limit or set data.truncation=filter"
                    )
                too_long += 1
                continue
            prompts.append(Prompt(ids=ids, text=text, answer=str(row[cfg.answer_key])))
    if not prompts:
        raise ConfigError(f"data files {files} hold no usable prompt after filtering "
                          f"({bad} bad rows, {too_long} over data.max_prompt_length); check the files and keys")
    return prompts, {"data/bad_rows": bad, "data/filtered_too_long": too_long}


class PromptSampler:
    """Epoch-wise seeded shuffle with a resumable position; the same order on every rank."""

    def __init__(self, prompts: list[Prompt], seed: int, shuffle: bool = True):
        self.prompts, self.seed, self.shuffle = prompts, seed, shuffle
        self.epoch, self.index = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self, size: int) -> list[Prompt]:
        batch = []
        while len(batch) < size:
            if self.index >= len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._make_order()
            batch.append(self.prompts[self._order[self.index]])
            self.index += 1
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index, self.seed = state["epoch"], state["index"], state["seed"]
        self._order = self._make_order()
