"""Create the bundled demo's offline assets: a tiny random Qwen3 model, a tiny random Qwen3-MoE
(4 experts, top-2: configs/demo_moe_cpu.yaml), a tiny random Qwen3-VL with its processor
(configs/demo_vl_cpu.yaml), a tiny Qwen3 with the tool task's vocabulary (configs/demo_tool_cpu.yaml),
a tiny reward model that prefers the digits 5-9 (configs/demo_judge_cpu.yaml), the toy and tool tasks' data and the shapes task's images and questions.

    python scripts/prepare_demo.py --out demo_assets
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlcore import quiet  # noqa: E402
from rlcore.demo.tool import make_tool_data, make_tool_model  # noqa: E402
from rlcore.demo.toy import (  # noqa: E402
    DEMO_RM_PREFERRED, make_tiny_model, make_tiny_moe_model, make_tiny_reward_model, make_toy_data,
)
from rlcore.demo.vl import make_shapes_data, make_tiny_vl_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="demo_assets")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model_dir = os.path.join(args.out, "tiny_qwen3")
    models = ((model_dir, make_tiny_model), (os.path.join(args.out, "tiny_qwen3_moe"), make_tiny_moe_model),
              (os.path.join(args.out, "tiny_qwen3_vl"), make_tiny_vl_model),
              (os.path.join(args.out, "tiny_qwen3_tool"), make_tool_model),
              (os.path.join(args.out, "tiny_rm_high_digits"),
               lambda d, seed: make_tiny_reward_model(d, preferred=DEMO_RM_PREFERRED, seed=seed)))
    for folder, make in models:
        if not os.path.isfile(os.path.join(folder, "config.json")):
            with quiet.filtered_output():  # transformers' "Writing model shards" progress bar
                make(folder, seed=args.seed)
    make_toy_data(os.path.join(args.out, "data"), seed=args.seed)
    make_tool_data(os.path.join(args.out, "data"), seed=args.seed)
    if not os.path.isfile(os.path.join(args.out, "shapes", "shapes_val.jsonl")):
        make_shapes_data(os.path.join(args.out, "shapes"), seed=args.seed)
    print(f"demo assets in {args.out}/ (model: {model_dir}, data: {args.out}/data)")


if __name__ == "__main__":
    main()
