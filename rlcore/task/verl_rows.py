"""verl's data rows, read as they are and written: the layout verl's examples/data_preprocess/
gsm8k.py, math_dataset.py and geo3k.py write (verl 1dda039) and verl/utils/dataset/rl_dataset.py reads:

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "... <image> ..."}],      # chat messages, always templated
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, ...},
     "images": [{"bytes": b"...", "path": "..."}]}                     # VL rows; "videos" likewise

Training files whose rows have this layout (``data_source``, a chat-message ``prompt`` at
data.prompt_key, ``reward_model.ground_truth``) are verl's: the data keys left null are filled as
verl reads them (``resolve_data``: data.answer_key reward_model.ground_truth, data.apply_chat_template
true, data.image_key images when the rows carry images), and reward.components null becomes
{verl: 1.0}, verl's scorer by data_source (rlcore.config.resolve). Videos are refused per row.
"""

from __future__ import annotations

import dataclasses
import os

from rlcore.errors import ConfigError

ANSWER_KEY = "reward_model.ground_truth"  # verl's RewardManager reads reward_model["ground_truth"]
SOURCE_KEY = "data_source"  # verl's reward_fn_key default (naive.py:63)
IMAGE_KEY, VIDEO_KEY = "images", "videos"  # rl_dataset.py:109-110 defaults
PLAIN_ANSWER_KEY = "answer"  # data.answer_key null on other rows
NO_SOURCE = "(none)"  # sources(): rows without a data_source
PARQUET_EXTS = (".parquet", ".pq")
PEEK_ROWS = 16  # rows read from the head of each file to recognise the layout and its images


def is_verl_row(row, prompt_key: str = "prompt") -> bool:
    """A row in verl's layout: data_source, reward_model.ground_truth and chat messages."""
    if not isinstance(row, dict) or SOURCE_KEY not in row:
        return False
    reward = row.get("reward_model")
    return isinstance(reward, dict) and "ground_truth" in reward and isinstance(row.get(prompt_key), list)


def head_rows(path: str, n: int = PEEK_ROWS, columns: list[str] | None = None) -> list[dict]:
    """The first ``n`` rows of a Parquet or JSONL file (unreadable rows skipped; [] when none);
    ``columns``: of a Parquet file, only those that exist (a geo3k file's images stay unread)."""
    if path.lower().endswith(PARQUET_EXTS):
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
            keep = [c for c in columns if c in pf.schema_arrow.names] if columns else None
            batch = next(pf.iter_batches(batch_size=n, columns=keep), None)
        except Exception:  # not Parquet: the reader names the file later
            return []
        return batch.to_pylist() if batch is not None else []
    import json

    rows = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if len(rows) >= n:
                    break
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except ValueError:
                        continue
    except OSError:
        return []
    return rows


@dataclasses.dataclass
class VerlFiles:
    """Training files found in verl's layout."""

    files: list[str]
    images: bool  # a row of the head of a file lists images
    columns: list[str]  # the first file's columns


def detect(files: list[str], prompt_key: str = "prompt") -> VerlFiles | None:
    """The training files in verl's layout (judged by their first rows), None when none is; a mix
    of verl's and other rows is a ConfigError (one set of data keys reads every file)."""
    verl, other, images, columns = [], [], False, []
    wanted = [SOURCE_KEY, "reward_model", prompt_key, IMAGE_KEY]
    for path in files:
        rows = head_rows(path, columns=wanted) if os.path.isfile(path) else []
        if not rows:
            continue
        if is_verl_row(rows[0], prompt_key):
            verl.append(path)
            images = images or any(r.get(IMAGE_KEY) for r in rows if isinstance(r, dict))
            columns = columns or column_names(path)
        else:
            other.append(path)
    if verl and other:
        raise ConfigError(f"data.train_files mixes verl's rows ({verl[0]}: data_source, prompt messages, "
                          f"reward_model.ground_truth) with other rows ({other[0]}); one set of data keys reads every "
                          f"file: convert one kind (scripts/convert_data.py reads and writes both), or set "
                          f"data.answer_key and data.apply_chat_template for the files yourself")
    return VerlFiles(verl, images, columns) if verl else None


def column_names(path: str) -> list[str]:
    """A Parquet file's columns, or the keys of a JSONL file's first row, sorted."""
    if path.lower().endswith(PARQUET_EXTS):
        import pyarrow.parquet as pq

        return sorted(pq.read_schema(path).names)
    rows = head_rows(path, n=1)
    return sorted(rows[0]) if rows and isinstance(rows[0], dict) else []


def resolve_data(data, found: VerlFiles | None):
    """``data`` (a DataConfig) with its null keys filled: verl's reading for verl's rows, else the
    plain defaults (answer, no chat template, no images). Keys set by the user stay."""
    return dataclasses.replace(
        data,
        answer_key=data.answer_key or (ANSWER_KEY if found else PLAIN_ANSWER_KEY),
        apply_chat_template=bool(found) if data.apply_chat_template is None else data.apply_chat_template,
        image_key=data.image_key or (IMAGE_KEY if found and found.images else None))


def sources(files: list[str]) -> dict[str, list]:
    """data_source -> [rows, first location] over ``files`` (only that column of a Parquet file is read)."""
    out: dict[str, list] = {}
    for path in files:
        for where, source in _source_column(path):
            key = source if isinstance(source, str) else NO_SOURCE if source is None else repr(source)
            out.setdefault(key, [0, where])[0] += 1
    return out


def _source_column(path: str) -> list[tuple[str, object]]:
    """(location as the row readers name it, data_source or None) of every row."""
    if path.lower().endswith(PARQUET_EXTS):
        import pyarrow.parquet as pq

        try:
            if SOURCE_KEY in pq.read_schema(path).names:
                values = pq.read_table(path, columns=[SOURCE_KEY]).column(SOURCE_KEY).to_pylist()
            else:
                values = [None] * pq.ParquetFile(path).metadata.num_rows
        except Exception:  # not Parquet: the row reader names the file
            return []
        return [(f"{path}: row {i}", v) for i, v in enumerate(values, 1)]
    import json

    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # the row reader names it
                out.append((f"{path}:{lineno}", row.get(SOURCE_KEY) if isinstance(row, dict) else None))
    return out


def row_fix(row, problem: str) -> str | None:
    """The fix for a bad verl row (None for other rows: the generic one applies)."""
    if not is_verl_row(row) and not (isinstance(row, dict) and SOURCE_KEY in row and "reward_model" in row):
        return None
    if "lacks key" in problem and ANSWER_KEY not in problem and is_verl_row(row):
        return (f"it is a verl row, whose reference answer is {ANSWER_KEY}: set data.answer_key: {ANSWER_KEY} (or "
                f"leave data.answer_key unset: verl's rows are recognised)")
    if "reward_model" in problem or "ground_truth" in problem:
        return ("a verl row holds its reference answer as reward_model: {style: rule, ground_truth: ...}, as verl's "
                "examples/data_preprocess scripts write it; fix the row")
    if "prompt" in problem or "chat messages" in problem:
        return "a verl row's prompt is a list of chat messages [{role: user, content: ...}]; fix the row"
    if "image" in problem:
        return ("a verl row lists its images under images ([{bytes, path}], one per <image> in the prompt's "
                "messages) and needs a vision-language model.path; fix the row")
    return None


def video_problem(row) -> str | None:
    """verl rows may carry videos (rl_dataset.py:350-365); this trainer takes images only."""
    videos = row.get(VIDEO_KEY) if isinstance(row, dict) else None
    if not videos:
        return None
    return (f"has {len(videos) if isinstance(videos, list) else 1} video(s) under {VIDEO_KEY!r}: video prompts "
            f"are not supported (images are); drop the row's videos or the row")


def check_sources(found: dict[str, list], key: str) -> None:
    """Every data_source has a verl scorer here (``found``: ``sources()``; ``key``: the components'
    config key, for the message). ConfigError naming the first row of the first one that has none."""
    from rlcore.task import verl_scores

    for source, (count, where) in found.items():
        problem = f"it has no {SOURCE_KEY}" if source == NO_SOURCE else verl_scores.refusal(source)
        if problem:
            raise ConfigError(
                f"{where} (and {count - 1} more) cannot be scored by the verl component of {key}: {problem}. The "
                f"verl component scores {', '.join(verl_scores.supported_sources())}; score these rows with your own "
                f"function (reward.fn: file.py:compute_score, verl's custom_reward_function), or fix their "
                f"data_source")


def startup_line(found: VerlFiles | None, data, components: dict, counts: dict[str, list]) -> str | None:
    """The "verl rows: ..." start-up line: what was read how, and what scores it (None: no verl rows)."""
    if found is None:
        return None
    names = ", ".join(os.path.basename(f) for f in found.files)
    read = (f"data.answer_key={data.answer_key}, data.apply_chat_template={str(data.apply_chat_template).lower()}"
            f"{f', data.image_key={data.image_key}' if data.image_key else ''}")
    by_source = ", ".join(f"{s} ({n} rows)" for s, (n, _) in sorted(counts.items()))
    scored = (f"verl's scorer by data_source: {by_source}" if "verl" in components else
              f"reward.components={components} (not verl's scorers: set reward.components: {{verl: 1.0}} for them)")
    return f"verl rows: {names} ({', '.join(found.columns)}) read with {read}; reward: {scored}"


def to_verl_row(prompt, answer, data_source: str, *, images: list | None = None, extra_info: dict | None = None,
                ability: str = "math") -> dict:
    """One row in verl's layout (examples/data_preprocess/gsm8k.py:55-73, geo3k.py:60-80): ``prompt``
    text becomes one user message (chat messages stay as they are); ``images`` ({bytes, path}
    dicts, one per <image> in the text) only when given."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    row = {"data_source": data_source, "prompt": messages, "ability": ability,
           "reward_model": {"style": "rule", "ground_truth": answer}, "extra_info": dict(extra_info or {})}
    if images is not None:
        row[IMAGE_KEY] = images
    return row


def from_verl_row(row: dict, prompt_key: str = "prompt") -> dict:
    """A verl row as this trainer's plain row: the prompt (one user message's text, or the messages),
    the answer (reward_model.ground_truth), and data_source, extra_info and images kept."""
    messages = row[prompt_key]
    only_user = len(messages) == 1 and messages[0].get("role") == "user"
    out = {"prompt": messages[0]["content"] if only_user else messages,
           "answer": row["reward_model"]["ground_truth"], SOURCE_KEY: row[SOURCE_KEY]}
    for key in ("extra_info", IMAGE_KEY):
        if row.get(key) is not None:
            out[key] = row[key]
    return out
