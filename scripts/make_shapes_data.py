"""Write the offline "shapes" task for vision-language GRPO: small images of 1-4 coloured shapes
(circle, square, triangle; red, green, blue, yellow) on a plain background, each with a question
whose one-word answer is exact (how many shapes; the colour of a shape kind drawn once; the colour
of the larger of two shapes). Scored with the first_word_match reward.

    python scripts/make_shapes_data.py --out demo_assets/shapes [--n_train 2000] [--n_val 200]
        [--size 96] [--parquet]

JSONL rows name their PNG files relative to the data file ({"prompt": "<image> how many shapes are
there ? answer with one word .", "images": ["images/shapes_train_00000.png"], "answer": "3"});
with --parquet the image bytes are inside the rows ({"bytes": ..., "path": ...}), the layout of
public image sets such as geo3k. Train with data.image_key: images, data.apply_chat_template: true.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlcore.demo.vl import make_shapes_data  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n_train", type=int, default=2000)
    ap.add_argument("--n_val", type=int, default=200)
    ap.add_argument("--size", type=int, default=96, help="image side in pixels (96 = 9 image tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parquet", action="store_true", help="image bytes inside Parquet rows instead of PNG files")
    args = ap.parse_args()
    train, val = make_shapes_data(args.out, n_train=args.n_train, n_val=args.n_val, seed=args.seed, size=args.size,
                                  parquet=args.parquet)
    print(f"shapes data: {train} ({args.n_train} rows), {val} ({args.n_val} rows)")


if __name__ == "__main__":
    main()
