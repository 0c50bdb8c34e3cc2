"""Converting prompt data between layouts (scripts/convert_data.py is the command; its --help lists
the formats): public math sets the user has on disk (GSM8K, MATH, Geometry3K) -> this trainer's
rows ``{"prompt", "answer"}`` or verl's rows (rlcore.task.verl_rows), and verl's rows -> this
trainer's. Rows already in verl's layout are read as such whatever the format named (their
instruction is in their prompt already: none is appended unless asked). Written as verl's rows, a
format's rows get verl's data_source and instruction (examples/data_preprocess/gsm8k.py,
math_dataset.py, geo3k.py).
"""

from __future__ import annotations

import json
import os
import re

from rlcore.task import verl_rows

DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def gsm8k_answer(text: str) -> str | None:
    """The number after the last '#### ' of a GSM8K answer, without thousands separators."""
    match = re.search(r"####\s*(.+?)\s*$", str(text).strip())
    if not match:
        return None
    return match.group(1).replace(",", "").strip() or None


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} (balanced braces), or of ``\\boxed x``."""
    text = str(text)
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if text.startswith(" ", i) and not text.startswith("{", i):  # "\boxed 5"
        m = re.match(r"\s+([^\s$]+)", text[i:])
        return m.group(1) if m else None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1: j].strip() or None
    return None  # unbalanced


def plain_answer(text) -> str | None:
    return str(text).strip() or None if text is not None else None


FORMATS = {
    "gsm8k": ("question", "answer", gsm8k_answer),
    "math": ("problem", "solution", last_boxed),
    "geo3k": ("problem", "answer", plain_answer),
}
IMAGE_FORMATS = {"geo3k": "images"}  # formats whose rows carry images, and under which key
PLACEHOLDER = "<image>"  # rlcore.task.images.IMAGE_PLACEHOLDER


def read_any(path: str) -> list[dict]:
    if path.lower().endswith((".parquet", ".pq")):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with open(path) as f:
        text = f.read()
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def convert_rows(rows: list[dict], fmt: str, instruction: str | None, keep_fields: bool, strict: bool,
                 where: str = "input") -> tuple[list[dict], int]:
    """Rows of format ``fmt`` (or verl's, recognised per row) -> this trainer's rows, and how many
    were skipped. ``instruction`` None: DEFAULT_INSTRUCTION, but none for verl's rows."""
    out, skipped = [], 0
    plain_instruction = DEFAULT_INSTRUCTION if instruction is None else instruction
    for i, row in enumerate(rows, 1):
        if verl_rows.is_verl_row(row):
            new = verl_rows.from_verl_row(row)
            if instruction and isinstance(new["prompt"], str):
                new["prompt"] = f"{new['prompt']}\n{instruction}"
            out.append(new)
            continue
        if fmt == "verl":
            if strict:
                raise ValueError(f"{where} row {i} is not a verl row (data_source, prompt messages, "
                                 f"reward_model.ground_truth); drop --strict to skip such rows")
            skipped += 1
            continue
        q_key, a_key, extract = FORMATS[fmt]
        answer = extract(row.get(a_key, "")) if isinstance(row, dict) and q_key in row else None
        if answer is None:
            if strict:
                raise ValueError(f"{where} row {i}: no {fmt} question/answer found "
                                 f"(keys {q_key!r}, {a_key!r}); drop --strict to skip such rows")
            skipped += 1
            continue
        prompt = str(row[q_key]).strip()
        images = _images(row, fmt)
        if images and prompt.count(PLACEHOLDER) == 0:
            prompt = PLACEHOLDER * len(images) + prompt
        if images is not None and prompt.count(PLACEHOLDER) != len(images):
            if strict:
                raise ValueError(f"{where} row {i}: {prompt.count(PLACEHOLDER)} {PLACEHOLDER!r} placeholders "
                                 f"for {len(images)} images; drop --strict to skip such rows")
            skipped += 1
            continue
        if plain_instruction:
            prompt = f"{prompt}\n{plain_instruction}"
        new = {"prompt": prompt, "answer": answer}
        if images is not None:
            new["images"] = images
        if keep_fields:
            new.update({k: v for k, v in row.items() if k not in (q_key, a_key, IMAGE_FORMATS.get(fmt))})
        out.append(new)
    return out, skipped


def _images(row: dict, fmt: str) -> list[dict] | None:
    """The row's images as {bytes, path} dicts (None for a text format)."""
    key = IMAGE_FORMATS.get(fmt)
    if key is None:
        return None
    images = row.get(key) or []
    images = images if isinstance(images, list) else [images]
    return [im if isinstance(im, dict) else {"bytes": im, "path": None} for im in images]


def images_to_files(path: str, rows: list[dict]) -> None:
    """JSONL cannot hold bytes: write each image to <out>_images/ and name it relative to ``path``."""
    folder = os.path.splitext(os.path.abspath(path))[0] + "_images"
    os.makedirs(folder, exist_ok=True)
    for i, row in enumerate(rows):
        for j, image in enumerate(row.get("images") or []):
            name = f"{i:06d}_{j}.png"
            with open(os.path.join(folder, name), "wb") as f:
                f.write(image["bytes"])  # the original encoding; PIL reads it whatever the suffix
            row["images"][j] = os.path.join(os.path.basename(folder), name)


def write_rows(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if any("images" in r for r in rows) and not path.lower().endswith((".parquet", ".pq")):
        images_to_files(path, rows)
    if path.lower().endswith((".parquet", ".pq")):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
        return
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")



# verl's data_source and instruction of each format (examples/data_preprocess/gsm8k.py:41,52,
# math_dataset.py:40,52, geo3k.py:31,44-48)
VERL_FORMATS = {
    "gsm8k": ("openai/gsm8k", 'Let\'s think step by step and output the final answer after "####".'),
    "math": ("DigitalLearningGmbH/MATH-lighteval", "Let's think step by step and output the final answer within \\boxed{}."),
    "geo3k": ("hiyouga/geometry3k", "You FIRST think about the reasoning process as an internal monologue and then "
              "provide the final answer. The reasoning process MUST BE enclosed within <think> </think> tags. The "
              "final answer MUST BE put in \\boxed{}."),
}


def to_verl(rows: list[dict], fmt: str, instruction: str | None, split: str) -> list[dict]:
    """This trainer's rows (``convert_rows(..., instruction="")``) -> verl's rows: a format's
    data_source and verl's instruction (``instruction`` None) after a space, as verl's preprocessing
    joins them; rows that came from verl keep their data_source and extra_info."""
    source, verl_instruction = VERL_FORMATS.get(fmt, (None, ""))
    instruction = verl_instruction if instruction is None else instruction
    out = []
    for i, row in enumerate(rows):
        prompt, was_verl = row["prompt"], bool(row.get(verl_rows.SOURCE_KEY))
        if instruction and isinstance(prompt, str) and not was_verl:  # verl's rows hold theirs already
            prompt = f"{prompt} {instruction}"
        data_source = row.get(verl_rows.SOURCE_KEY) or source
        if data_source is None:
            raise ValueError(f"row {i + 1} has no data_source and the format {fmt!r} names none; convert with "
                             f"gsm8k, math or geo3k")
        extra = row.get("extra_info") or {"split": split, "index": i}
        out.append(verl_rows.to_verl_row(prompt, row["answer"], data_source, images=row.get("images"), extra_info=extra))
    return out
