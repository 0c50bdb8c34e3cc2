"""Convert public math data sets the user already has on disk, and verl's data rows, into the
trainer's prompt rows (``{"prompt": ..., "answer": ...}`` JSONL, or Parquet for a ``.parquet``
output), or into verl's rows (``--to verl``). The logic is rlcore/task/convert.py.

    python scripts/convert_data.py gsm8k train.jsonl --out data/gsm8k_train.jsonl
    python scripts/convert_data.py math  test.parquet --out data/math_test.jsonl --instruction ""
    python scripts/convert_data.py geo3k geometry3k/data/train-*.parquet --out data/geo3k_train.parquet
    python scripts/convert_data.py gsm8k ~/data/gsm8k/train.parquet --out data/gsm8k_train.jsonl   # verl's rows
    python scripts/convert_data.py gsm8k train.jsonl --out data/gsm8k_verl.parquet --to verl       # for verl

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
  verl   verl's rows of any data_source.
Rows in verl's layout (data_source, prompt messages, reward_model.ground_truth: what verl's
examples/data_preprocess scripts write) are read as such under any format: the prompt, the
ground truth as the answer, data_source and extra_info kept (the trainer also reads verl's files
as they are: docs/real_data.md). ``--to verl`` writes verl's layout with the format's data_source
and verl's instruction. A row whose answer cannot be extracted is skipped and counted (--strict:
an error instead). ``--instruction`` is appended to every prompt (default: one asking for a
\\boxed{} final answer, which the ``math`` reward reads; verl's own for --to verl; none for rows
that were verl's already). Extra source fields (e.g. level, type) are kept with --keep-fields.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlcore.task import convert  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("format", choices=sorted(convert.FORMATS) + ["verl"])
    ap.add_argument("inputs", nargs="+", help="JSONL / JSON / Parquet files")
    ap.add_argument("--out", required=True, help="output .jsonl or .parquet")
    ap.add_argument("--to", choices=["rlcore", "verl"], default="rlcore",
                    help="rlcore: {prompt, answer} rows; verl: verl's rows (data_source, prompt messages, reward_model)")
    ap.add_argument("--instruction", default=None, help='appended to prompts ("" for none)')
    ap.add_argument("--split", default="train", help="--to verl: extra_info.split of the rows")
    ap.add_argument("--keep-fields", action="store_true")
    ap.add_argument("--strict", action="store_true", help="a row without an extractable answer is an error")
    args = ap.parse_args(argv)
    rows, skipped = [], 0
    try:
        for path in args.inputs:
            if not os.path.isfile(path):
                sys.exit(f"error: input {path} does not exist")
            got, nskip = convert.convert_rows(convert.read_any(path), args.format,
                                              "" if args.to == "verl" else args.instruction, args.keep_fields,
                                              args.strict, path)
            rows += got
            skipped += nskip
        if args.to == "verl":
            rows = convert.to_verl(rows, args.format, args.instruction, args.split)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if not rows:
        sys.exit(f"error: no {args.format} rows with an extractable answer in {args.inputs}")
    convert.write_rows(args.out, rows)
    print(f"wrote {len(rows)} {'verl ' if args.to == 'verl' else ''}rows to {args.out} ({skipped} skipped: no "
          f"extractable answer, or image placeholders not matching the images)")


if __name__ == "__main__":
    main()
