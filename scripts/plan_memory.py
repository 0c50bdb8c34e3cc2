"""Memory plan before launch: per rank and per phase of the switch, will the run fit?

    .venv/bin/python scripts/plan_memory.py --config cfg.yaml --nproc 8 --nnodes 2 [--device-gb 80|64]
        [--device cuda|npu] [--json] [--longest] [-- --section.key value ...]

No GPU and no weights needed: ``model.path`` must hold the model's ``config.json`` only. Prints
the table of ``rlcore.plan.memory.format_plan``; with ``--json`` its last line is the plan as one
JSON object. ``--longest`` adds the longest sequence whose train phase fits one rank (one sequence
per micro-batch, ``rlcore.plan.sequence``) for each Ulysses size the world and the heads allow.
Exit code 0 when it fits, 1 when it does not, 2 on a bad config.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlcore.config import fail  # noqa: E402
from rlcore.plan.memory import format_plan, plan_from_config  # noqa: E402


DEVICE_GB = {"cuda": 80.0, "npu": 64.0}  # --device-gb's default: an H100 / A100-80GB, an Atlas A2 / A3 die

def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Script options before ``--``; the trainer's ``--section.key value`` overrides after it."""
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the trainer's YAML config")
    parser.add_argument("--nproc", type=int, required=True, help="ranks (devices) per node")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--device-gb", type=float, default=None,
                        help="memory of one device, GB (2^30 bytes); default 80 on cuda (H100/A100-80GB), 64 on "
                             "npu (Atlas A2/A3 dies)")
    parser.add_argument("--device", choices=("cuda", "npu"), default=None,
                        help="default: parallel.device of the config when cuda/npu, else cuda")
    parser.add_argument("--json", action="store_true", help="also print the plan as one JSON line, last")
    parser.add_argument("--longest", action="store_true",
                        help="the longest sequence the train phase fits per rank, per parallel.ulysses_size")
    return parser.parse_args(argv[:split]), argv[split + 1:]


def load_config(path: str, overrides: list[str], device: str | None):
    """The trainer's own parser, resolved for the planned device (not this machine's): the
    device is --device, else parallel.device when it names an accelerator, else cuda."""
    from rlcore.config.cli import parse_config

    argv = ["--config", path, *overrides]
    cfg = parse_config(argv, device_type=device or "cuda")
    if device is None and cfg.parallel.device == "npu":  # resolve again for the device it names
        return parse_config(argv, device_type="npu"), "npu"
    return cfg, device or "cuda"


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    cfg, device = load_config(args.config, overrides, args.device)
    if not os.path.isfile(os.path.join(cfg.model.path, "config.json")):
        fail(f"model.path={cfg.model.path!r} is invalid: no config.json there; the plan needs only that file")
    world = args.nproc * args.nnodes
    if world % cfg.rollout.tensor_parallel_size:
        fail(f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size!r} is invalid: "
             f"it must divide the world size {world}")
    try:
        plan = plan_from_config(cfg, world, args.device_gb or DEVICE_GB[device], device, nproc_per_node=args.nproc)
    except (KeyError, ValueError) as e:  # a config.json without a key the plan needs, an unknown dtype
        fail(f"model.path={cfg.model.path!r} is invalid for the plan: {e!r} in its config.json or model.dtype")
    print(format_plan(plan))
    if args.longest:
        from rlcore.plan.sequence import longest_train_sequence, ulysses_sizes

        for u in ulysses_sizes(plan.inputs):
            print(f"longest sequence the train phase fits per rank, parallel.ulysses_size {u}: "
                  f"{longest_train_sequence(plan.inputs, u)} tokens ({-(-longest_train_sequence(plan.inputs, u) // u)}"
                  f" per rank per forward)")
    if args.json:
        print(json.dumps(plan.to_json()))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
