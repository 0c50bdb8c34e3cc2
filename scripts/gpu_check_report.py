"""The verdict of scripts/gpu_check.sh: reads the check run's metrics.jsonl and prints ONE JSON line
with memory per phase (the last step's ``memory/*``), step time, the largest trainer-vs-vLLM
log-prob difference after the weight sync, and ``"pass"`` with the reasons when it fails.

    python scripts/gpu_check_report.py --run-dir /tmp/rlcore_gpu_check.me/run [--steps 3] [--max-logp-diff 1e-3]
    python scripts/gpu_check_report.py --probe cuda|npu    # prints the device count, or "ERROR ..."

A check passes when the trainer exited 0, logged every step, logged ``rollout/mismatch_max``
(max |trainer log-prob - vLLM log-prob| over the response tokens of a step) and
``rollout/mismatch_kl`` on every step, the largest mismatch_max is at most --max-logp-diff, no
step had a non-finite loss or gradient norm, and memory and step time were logged.
Exit code: 0 pass, 1 fail.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

MISMATCH_MAX = "rollout/mismatch_max"
MISMATCH_KL = "rollout/mismatch_kl"
STEP_TIME = "timing/step_s"


def read_rows(run_dir: str) -> list[dict]:
    """metrics.jsonl rows by step (the last row of a step wins)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    by_step: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                by_step[int(row["step"])] = row
    return [by_step[s] for s in sorted(by_step)]


def number(value) -> float:
    """A metric value: a float, or "nan"/"inf" as metrics.jsonl writes non-finite ones."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _round(x: float, digits: int = 6):
    return round(x, digits) if math.isfinite(x) else str(x)


def report(rows: list[dict], *, steps: int, max_logp_diff: float, rc: int = 0, log: str | None = None) -> dict:
    reasons: list[str] = []
    if rc != 0:
        reasons.append(f"the trainer exited {rc}" + (f" (see {log})" if log else ""))
    if len(rows) < steps:
        reasons.append(f"{len(rows)} of {steps} steps logged in metrics.jsonl")
    out: dict = {"pass": False, "reasons": reasons, "steps_logged": len(rows)}
    if not rows:
        return out
    last = rows[-1]

    out["step_s"] = _round(number(last[STEP_TIME]), 3) if STEP_TIME in last else None
    out["step_s_all"] = [_round(number(r.get(STEP_TIME)), 3) for r in rows]
    if STEP_TIME not in last:
        reasons.append(f"metric {STEP_TIME} is missing from metrics.jsonl")

    for key, name in ((MISMATCH_MAX, "mismatch_max"), (MISMATCH_KL, "mismatch_kl")):
        missing = [r["step"] for r in rows if key not in r]
        values = [number(r[key]) for r in rows if key in r]
        out[f"{name}_per_step"] = [_round(v, 8) for v in values]
        out[name] = _round(max(values, key=lambda v: (math.isnan(v), v)), 8) if values else None
        if missing:
            reasons.append(f"metric {key} is missing from metrics.jsonl (steps {missing}): this trainer does not "
                           f"log the trainer-vs-vLLM log-prob difference, so the weight sync cannot be checked")
        elif not all(math.isfinite(v) for v in values):
            reasons.append(f"metric {key} is not finite: {out[f'{name}_per_step']}")
    worst = number(out.get("mismatch_max"))
    out["max_logp_diff"] = max_logp_diff
    if math.isfinite(worst) and worst > max_logp_diff:
        reasons.append(f"{MISMATCH_MAX}={worst:.3g} > {max_logp_diff:g}: vLLM's log-probs after the weight sync "
                       f"disagree with the trainer's (narrow it down with WEIGHT_LOAD=reload or ENFORCE_EAGER=true)")

    skipped = number(last.get("actor/skipped_steps", 0))
    if skipped != 0:
        reasons.append(f"actor/skipped_steps={last.get('actor/skipped_steps')}: non-finite loss or gradient norm")

    memory = {k.removeprefix("memory/"): _round(number(v), 4) for k, v in sorted(last.items())
              if k.startswith("memory/")}
    out["memory_gb"] = memory
    if not memory:
        reasons.append("no memory/* metrics in the last step")
    out["pass"] = not reasons
    return out


def probe(device: str) -> str:
    """The number of visible devices, or a line starting with ERROR saying why there are none."""
    try:
        import torch

        if device == "npu":
            import torch_npu  # noqa: F401  (registers torch.npu)

            ok, n = torch.npu.is_available(), torch.npu.device_count()
        else:
            ok, n = torch.cuda.is_available(), torch.cuda.device_count()
    except Exception as e:  # noqa: BLE001  any import failure means: no usable stack
        return f"ERROR importing torch{'_npu' if device == 'npu' else ''} failed: {type(e).__name__}: {e}"
    if not ok or n < 1:
        built = ""
        if device == "cuda":
            built = f", built for CUDA {torch.version.cuda}" if torch.version.cuda else ", a CPU-only build"
        return f"ERROR torch.{device}.is_available() is False (torch {torch.__version__}{built})"
    return str(n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probe", choices=["cuda", "npu"], help="print the visible device count and exit")
    ap.add_argument("--run-dir", help="the check run's trainer.output_dir (holds metrics.jsonl)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-logp-diff", type=float, default=1e-3)
    ap.add_argument("--rc", type=int, default=0, help="the trainer's exit code")
    ap.add_argument("--log", help="the trainer's log file (named in the reasons)")
    ap.add_argument("--device")
    ap.add_argument("--nproc", type=int)
    ap.add_argument("--tp", type=int)
    args = ap.parse_args(argv)
    if args.probe:
        print(probe(args.probe))
        return 0
    if not args.run_dir:
        ap.error("--run-dir is required")
    result = report(read_rows(args.run_dir), steps=args.steps, max_logp_diff=args.max_logp_diff, rc=args.rc,
                    log=args.log)
    head = {"check": "gpu_check", "pass": result.pop("pass")}
    extra = {k: v for k, v in (("device", args.device), ("nproc", args.nproc), ("tp", args.tp)) if v is not None}
    print(json.dumps({**head, **result, **extra, "run_dir": args.run_dir}), flush=True)
    return 0 if head["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
