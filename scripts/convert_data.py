"""Convert public math data sets the user already has on disk into the trainer's prompt rows
(``{"prompt": ..., "answer": ...}`` JSONL, or Parquet for a ``.parquet`` output).

    python scripts/convert_data.py gsm8k train.jsonl --out data/gsm8k_train.jsonl
    python scripts/convert_data.py math  test.parquet --out data/math_test.jsonl --instruction ""
    python scripts/convert_data.py geo3k geometry3k/data/train-*.parquet --out data/geo3k_train.parquet

Formats (input JSONL, a JSON list, or Parquet; several input files are concatenated):
  gsm8k  rows {"question", "answer"}; the gold answer follows "#### " at the end of "answer"
         (thousands separators removed).
  math   MATH-style rows {"problem", "solution"}; the gold answer is the content of the last
         \\boxed{...} (or \\fbox{...}) in "solution", nested braces included.
  geo3k  the public Geometry3K Parquet files (hiyouga/geometry3k): rows {"images": [{"bytes",
         "path"}], "problem", "answer"}; the problem holds one "<image>" placeholder per image
         (prepended when missing). Rows keep their images: inside the rows for a .parquet
         output; as PNG files in <out>_images/ named relative to the output for .jsonl. Train
         with data.image_key: images, data.apply_chat_template: true, a vision-language model.
A row whose answer cannot be extracted is skipped and counted (--strict: an error instead).
``--instruction`` is appended to every prompt (default asks for a \\boxed{} final answer, which the
``math`` reward reads). Extra source fields (e.g. level, type) are kept with --keep-fields.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

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


def convert_rows(rows: list[dict], fmt: str, instruction: str, keep_fields: bool, strict: bool,
                 where: str = "input") -> tuple[list[dict], int]:
    q_key, a_key, extract = FORMATS[fmt]
    out, skipped = [], 0
    for i, row in enumerate(rows, 1):
        answer = extract(row.get(a_key, "")) if isinstance(row, dict) and q_key in row else None
        if answer is None:
            if strict:
                raise SystemExit(f"error: {where} row {i}: no {fmt} question/answer found "
                                 f"(keys {q_key!r}, {a_key!r}); drop --strict to skip such rows")
            skipped += 1
            continue
        prompt = str(row[q_key]).strip()
        images = _images(row, fmt)
        if images and prompt.count(PLACEHOLDER) == 0:
            prompt = PLACEHOLDER * len(images) + prompt
        if images is not None and prompt.count(PLACEHOLDER) != len(images):
            if strict:
                raise SystemExit(f"error: {where} row {i}: {prompt.count(PLACEHOLDER)} {PLACEHOLDER!r} placeholders "
                                 f"for {len(images)} images; drop --strict to skip such rows")
            skipped += 1
            continue
        if instruction:
            prompt = f"{prompt}\n{instruction}"
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("format", choices=sorted(FORMATS))
    ap.add_argument("inputs", nargs="+", help="JSONL / JSON / Parquet files")
    ap.add_argument("--out", required=True, help="output .jsonl or .parquet")
    ap.add_argument("--instruction", default=DEFAULT_INSTRUCTION, help='appended to prompts ("" for none)')
    ap.add_argument("--keep-fields", action="store_true")
    ap.add_argument("--strict", action="store_true", help="a row without an extractable answer is an error")
    args = ap.parse_args(argv)
    rows, skipped = [], 0
    for path in args.inputs:
        if not os.path.isfile(path):
            sys.exit(f"error: input {path} does not exist")
        got, nskip = convert_rows(read_any(path), args.format, args.instruction, args.keep_fields, args.strict, path)
        rows += got
        skipped += nskip
    if not rows:
        sys.exit(f"error: no {args.format} rows with an extractable answer in {args.inputs}")
    write_rows(args.out, rows)
    print(f"wrote {len(rows)} rows to {args.out} ({skipped} skipped: no extractable answer, or image placeholders not matching the images)")


if __name__ == "__main__":
    main()
