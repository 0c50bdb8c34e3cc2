"""Prompt data: local JSONL or Parquet files -> tokenized prompts, a seeded shuffle per epoch, and a
position (epoch, index) that a checkpoint can store. Every rank builds the same order and takes its
slice.

Rows carry ``data.prompt_key`` and ``data.answer_key`` (dotted paths such as
``reward_model.ground_truth`` reach into nested objects). A prompt is raw text, or a list of chat
messages ``[{"role": ..., "content": ...}]``; with ``data.apply_chat_template`` either form is
rendered with the tokenizer's chat template (text becomes one user message), after an optional
``data.system_prompt``. With ``data.image_key`` a row also lists images, one per ``<image>``
placeholder in its prompt; they are checked (found, decodable, as many as placeholders) and kept
as encoded bytes, and the prompt's length counts the tokens they expand to (``rlcore.task.images``).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlcore.errors import ConfigError
from rlcore.task import images as vision
from rlcore.task import verl_rows
from rlcore.task.config import CUTTING_MODES

if TYPE_CHECKING:  # annotations only
    from rlcore.task.config import DataConfig

PARQUET_EXTS = (".parquet", ".pq")


@dataclass
class Prompt:
    ids: list[int]  # prompt token ids (one image token per image: vLLM expands them)
    text: str
    answer: str
    images: list[bytes] | None = None  # encoded images, in placeholder order (data.image_key)
    row: dict | None = None  # the data row (multi-turn environments reset on it)


def get_key(row: dict, key: str):
    """``row[key]``, following dots into nested dicts; KeyError when a part is missing."""
    if key in row:
        return row[key]
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(key)
        value = value[part]
    return value


def row_problem(row, cfg: DataConfig) -> str | None:
    """Why a row cannot be used, or None when it can."""
    if not isinstance(row, dict):
        return "is not an object"
    missing = []
    for key in (cfg.prompt_key, cfg.answer_key or verl_rows.PLAIN_ANSWER_KEY):
        try:
            if get_key(row, key) is None:
                missing.append(key)
        except KeyError:
            missing.append(key)
    if missing:
        return f"lacks key(s) {missing}"
    prompt = get_key(row, cfg.prompt_key)
    if isinstance(prompt, list):
        ok = all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                 for m in prompt)
        if not ok or not prompt:
            return f"has a {cfg.prompt_key!r} list that is not chat messages [{{role, content}}, ...]"
    elif not isinstance(prompt, str):
        return f"has a {cfg.prompt_key!r} of type {type(prompt).__name__} (expected text or chat messages)"
    elif not prompt.strip():
        return f"has an empty {cfg.prompt_key!r}"  # an empty prompt would stop the engine mid-run
    return None


def image_entries(row: dict, cfg: DataConfig) -> list:
    """The row's image entries ([] when ``data.image_key`` is off or the row has none)."""
    if not cfg.image_key:
        return []
    try:
        entries = get_key(row, cfg.image_key)
    except KeyError:
        return []
    return [] if entries is None else list(entries) if isinstance(entries, (list, tuple)) else [entries]


def placeholder_count(row: dict, cfg: DataConfig) -> int:
    prompt = get_key(row, cfg.prompt_key)
    texts = [m["content"] for m in prompt] if isinstance(prompt, list) else [prompt]
    return sum(t.count(vision.IMAGE_PLACEHOLDER) for t in texts)


def image_problem(row: dict, cfg: DataConfig, base_dir: str) -> str | None:
    """Why a row's images cannot be used (missing, undecodable, not one per placeholder), or None."""
    if not cfg.image_key:
        return None
    entries, placeholders = image_entries(row, cfg), placeholder_count(row, cfg)
    if len(entries) != placeholders:
        return (f"has {len(entries)} image(s) under {cfg.image_key!r} but {placeholders} "
                f"{vision.IMAGE_PLACEHOLDER!r} placeholder(s) in {cfg.prompt_key!r}; each image needs one "
                f"placeholder where it goes in the prompt")
    if entries and not cfg.apply_chat_template:
        return "has images, which need data.apply_chat_template=true (the chat template places the vision tokens)"
    for i, entry in enumerate(entries):
        try:
            vision.open_image(entry, base_dir)
        except ValueError as e:
            return f"has a bad image {i} under {cfg.image_key!r}: {e}"
    return None


def iter_raw_rows(path: str):
    """(location, row or None, parse error or None) for each non-empty row of a JSONL/Parquet file."""
    if path.lower().endswith(PARQUET_EXTS):
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:
            raise ConfigError(f"{path} is not a readable Parquet file ({type(e).__name__}: {e})") from e
        for i, row in enumerate(table.to_pylist(), 1):
            yield f"{path}: row {i}", row, None
        return
    # Undecodable bytes become a bad row with its line number, not a UnicodeDecodeError.
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                line.encode("utf-8")
            except UnicodeEncodeError:
                yield f"{path}:{lineno}", None, "is not UTF-8 text"
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line), None
            except json.JSONDecodeError as e:
                yield f"{path}:{lineno}", None, f"is not valid JSON ({e.msg})"


def read_rows(path: str, cfg: DataConfig) -> tuple[list[dict], int]:
    """Usable rows of a JSONL or Parquet file; (rows, bad_row_count). A bad row raises ConfigError
    naming file and line (JSONL) or row (Parquet), unless data.skip_bad_rows."""
    if not os.path.isfile(path):
        raise ConfigError(f"data file {path} does not exist; fix data.train_files / data.val_files")
    rows, bad = [], 0
    base_dir = os.path.dirname(os.path.abspath(path))
    for where, row, problem in iter_raw_rows(path):
        problem = problem or row_problem(row, cfg) or image_problem(row, cfg, base_dir) or verl_rows.video_problem(row)
        if problem is None:
            rows.append(row)
        elif cfg.skip_bad_rows:
            bad += 1
        else:
            fix = verl_rows.row_fix(row, problem) or "fix the row"
            raise ConfigError(f"{where} {problem}; {fix}, or set data.skip_bad_rows=true to skip such rows")
    return rows, bad


def render_prompt(row: dict, cfg: DataConfig, tokenizer, processor=None, chat=None) -> str:
    """The prompt text; ``chat`` (rlcore.agent.chat.ChatRenderer): multi-turn, rendered with the tools."""
    prompt = get_key(row, cfg.prompt_key)
    if chat is not None:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if cfg.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": cfg.system_prompt}] + messages
        return chat.prompt_text(messages)
    if not cfg.apply_chat_template:
        if isinstance(prompt, list):
            raise ConfigError(f"data.apply_chat_template=false but {cfg.prompt_key!r} holds chat messages; "
                              "set data.apply_chat_template=true")
        return prompt
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if cfg.image_key:  # "<image>" placeholders -> image items of the message content
        messages = [{**m, "content": vision.chat_content(m["content"], m["content"].count(vision.IMAGE_PLACEHOLDER))}
                    for m in messages]
    if cfg.system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": cfg.system_prompt}] + messages
    # A vision-language folder may keep its template with the processor only (chat_template.json)
    owner = tokenizer
    if getattr(tokenizer, "chat_template", None) is None and processor is not None:
        owner = processor.processor
    if getattr(owner, "chat_template", None) is None:
        raise ConfigError("data.apply_chat_template=true but the tokenizer has no chat template; "
                          "set data.apply_chat_template=false or use a chat model")
    return owner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def load_prompts(files: list[str], cfg: DataConfig, tokenizer, processor=None, chat=None) -> tuple[list[Prompt], dict]:
    """Tokenize every row; filter, reject or cut (data.truncation) over-long prompts. Returns (prompts,
    data/* stats: bad rows, filtered over-long prompts, prompts, and with a cutting mode the number cut).
    ``processor`` (a ``rlcore.task.images.VisionProcessor``) is needed for rows with images; ``chat``
    renders multi-turn prompts with the tools. Data keys left null are filled from the files first
    (verl's rows: rlcore.task.verl_rows; rlcore.config.resolve does it for a run)."""
    if cfg.answer_key is None or cfg.apply_chat_template is None:
        cfg = verl_rows.resolve_data(cfg, verl_rows.detect(files, cfg.prompt_key))
    prompts, bad, too_long, truncated = [], 0, 0, 0
    for path in files:
        rows, nbad = read_rows(path, cfg)
        bad += nbad
        base_dir = os.path.dirname(os.path.abspath(path))
        for row in rows:
            text = render_prompt(row, cfg, tokenizer, processor, chat)
            # The chat template already holds the special tokens (BOS etc.).
            ids = tokenizer(text, add_special_tokens=not (cfg.apply_chat_template or chat))["input_ids"]
            images = [vision.open_image(e, base_dir) for e in image_entries(row, cfg)]
            length = len(ids) + sum(processor.num_tokens(im) - 1 for im in images) if images else len(ids)
            if length > cfg.max_prompt_length:
                if cfg.truncation == "error":
                    raise ConfigError(
                        f"a prompt in {path} has {length} tokens (image tokens included) > data.max_prompt_length="
                        f"{cfg.max_prompt_length}; raise the limit or set data.truncation=filter"
                    )
                if cfg.truncation in CUTTING_MODES:  # text only (DataConfig refuses a cut with image_key)
                    ids = truncate_ids(ids, cfg.max_prompt_length, cfg.truncation)
                    text = tokenizer.decode(ids)  # what the model sees (validation examples show it)
                    truncated += 1
                else:
                    too_long += 1
                    continue
            prompts.append(Prompt(ids=ids, text=text, answer=str(get_key(row, cfg.answer_key)),
                                  images=[vision.encode_image(im) for im in images] or None,
                                  row=row))  # environments reset on it; judges read its fields
    if not prompts:
        raise ConfigError(f"data files {files} hold no usable prompt after filtering "
                          f"({bad} bad rows, {too_long} over data.max_prompt_length); check the files and keys")
    stats = {"data/bad_rows": bad, "data/filtered_too_long": too_long, "data/prompts": len(prompts)}
    if cfg.truncation in CUTTING_MODES:
        stats["data/truncated_too_long"] = truncated
    return prompts, stats


def truncate_ids(ids: list[int], max_len: int, mode: str) -> list[int]:
    """``ids`` cut to ``max_len`` tokens as verl's ``data.truncation`` cuts them: left keeps the last
    ``max_len``, right the first ``max_len``, middle the first ``max_len // 2`` and the last
    ``max_len - max_len // 2``. Shorter lists come back unchanged."""
    if len(ids) <= max_len:
        return list(ids)
    if mode == "left":
        return list(ids[len(ids) - max_len:])
    if mode == "right":
        return list(ids[:max_len])
    if mode == "middle":
        head = max_len // 2
        return list(ids[:head]) + list(ids[len(ids) - (max_len - head):])
    raise ValueError(f"unknown truncation mode {mode!r} (expected one of {CUTTING_MODES})")


def derive_seed(seed: int, offset: int) -> int:
    """The one formula for every seed derived from a run's seed: the data order of each epoch,
    each step's generation, validation (see generation_seed)."""
    return seed * 1_000_003 + offset


_VALIDATION_OFFSET = 500_009  # validation seeds stay apart from the training steps'


def generation_seed(seed: int, step: int, round_: int = 0, validation: bool = False) -> int:
    """vLLM seed of one generation call: per step (so a resumed run samples what the uninterrupted
    one did), per dynamic-sampling round or partial-rollout chunk (a round that reused the step's
    seed would draw the same random stream for its new prompts), and apart for validation."""
    return derive_seed(seed, step + (_VALIDATION_OFFSET if validation else 0)) + round_ * 2**62


class PromptSampler:
    """Epoch-wise seeded shuffle with a resumable position; the same order on every rank."""

    def __init__(self, prompts: list[Prompt], seed: int, shuffle: bool = True):
        self.prompts, self.seed, self.shuffle = prompts, seed, shuffle
        self.epoch, self.index = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(derive_seed(self.seed, self.epoch)).shuffle(order)
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
