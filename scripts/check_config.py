"""Dry run of a cluster config on a machine without its devices (a login node), before ``sbatch``.

    .venv/bin/python scripts/check_config.py --config cfg.yaml --device cuda|npu --nproc 8 [--nnodes 2]
        [--device-gb 80|64] [-- --section.key value ...]

Runs everything of the trainer's build that allocates no device memory, through the real
libraries' own validation (rlcore/run/dry_run.py): the config resolved for the device, the world size,
the attention kernel against the packages installed here, VeOmni's kernel choices with VeOmni's
device probe set to the device, every vLLM engine (policy and judges) through the installed
vLLM's ``EngineArgs.create_engine_config`` on this machine's platform (device-only settings stay
advisory; the check's line names them), and the memory plan per phase (checkpoint included).
``model.path`` needs the model's config.json (and, for vLLM, readable *.safetensors headers if any).
One line per check; exit code 0 when every check passes (warnings allowed), 2 naming the failures.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlcore import quiet  # noqa: E402

quiet.install()


DEVICE_GB = {"cuda": 80.0, "npu": 64.0}  # --device-gb's default: an H100 / A100-80GB, an Atlas A2 / A3 die


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the trainer's YAML config")
    parser.add_argument("--device", choices=("cuda", "npu"), required=True, help="the cluster's device")
    parser.add_argument("--nproc", type=int, required=True, help="ranks (devices) per node")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--device-gb", type=float, default=None,
                        help="memory of one device, GB (2^30 bytes); default 80 on cuda (H100/A100-80GB), 64 on "
                             "npu (Atlas A2/A3 dies)")
    parser.add_argument("--pre-hopper", action="store_true",
                        help="cuda: the cluster's GPUs are older than Hopper (A100, L40S): no flash-attn-4; by "
                             "default attention resolves for an SM90+ GPU with the pinned flash-attn-4")
    return parser.parse_args(argv[:split]), argv[split + 1:]


def main(argv: list[str] | None = None) -> int:
    from rlcore.run.dry_run import FAIL, dry_run

    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    with quiet.filtered_output():
        device_gb = args.device_gb or DEVICE_GB[args.device]
        checks = dry_run(["--config", args.config, *overrides], args.device, args.nproc, args.nnodes, device_gb,
                         pre_hopper=args.pre_hopper)
    for c in checks:
        print(c.line(), flush=True)
    failed = [c.name for c in checks if c.status == FAIL]
    world = args.nproc * args.nnodes
    if failed:
        print(f"check FAILED on {args.device} x {world}: {', '.join(dict.fromkeys(failed))}", flush=True)
        return 2
    print(f"check passed on {args.device} x {world}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
