"""The verdict of scripts/gpu_check.sh: reads each part's metrics.jsonl (OUT/PART/run) and prints ONE
JSON line with, per part, memory per phase (the last step's ``memory/*``), step time, the largest
trainer-vs-vLLM log-prob difference after the weight sync, what the part is for (the judge's
reward, the router agreement under R3) and ``"pass"`` with the reasons when it fails; then the
overall ``"pass"``.

    python scripts/gpu_check_report.py --out /tmp/rlcore_gpu_check.me --ran base=0 --ran judge=1 \
        --skipped 'moe_r3=why' [--steps 3] [--max-logp-diff 1e-3] [--min-router-agreement 0.5]
    python scripts/gpu_check_report.py --run-dir /tmp/rlcore_gpu_check.me/base/run [--part lora]   # one run
    python scripts/gpu_check_report.py --probe cuda|npu    # prints the device count, or "ERROR ..."
    python scripts/gpu_check_report.py --ascend-ops        # vllm-ascend's custom ops on this SoC, or "ERROR ..."

Every part passes when the trainer exited 0, logged every step, logged ``rollout/mismatch_max``
(max |trainer log-prob - vLLM log-prob| over the response tokens of a step) and
``rollout/mismatch_kl`` on every step, the largest mismatch_max is at most --max-logp-diff, no
step had a non-finite loss or gradient norm, and memory and step time were logged. On top:
judge: the judge's component ``reward/high_digit`` logged every step, finite, in [0, 1] (sigmoid),
every sample scored (``reward/high_digit_parse_fail_frac`` 0) and ``timing/judge_s`` logged;
lora: a non-zero finite ``actor/grad_norm`` every step (the adapter learns) and at least 2 steps
(the first sync of a trained adapter is checked at step 2); moe: ``rollout/experts_restored`` (expert
weights vLLM's wake-up swapped and the rollout put back) logged every step and finite; ulysses:
``perf/sp_pad_frac`` every step (the rows went through Ulysses); teacher: ``distill/reverse_kl`` and
``timing/teacher_s`` every step; moe_r3: ``actor/router_agreement``
(tokens whose trainer top-k already was vLLM's) at least --min-router-agreement every step and
``actor/router_replay_missing`` 0. The whole check passes when at least one part ran and every part
that ran passed (a skipped part, e.g. moe_r3 on NPU, is named with its reason). Exit code: 0 pass, 1 fail.
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
PARTS = ("base", "judge", "lora", "moe", "ulysses", "teacher", "moe_r3")
EXPERTS_RESTORED = "rollout/experts_restored"
JUDGE = "high_digit"  # the judge part's reward component (scripts/gpu_check.sh JUDGE)


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


def _per_step(rows: list[dict], key: str, out: dict, name: str, reasons: list[str]) -> list[float] | None:
    """``key``'s values on every step into out[name + "_per_step"]; None (with the reason) when a step
    lacks it or a value is not finite."""
    missing = [r["step"] for r in rows if key not in r]
    values = [number(r[key]) for r in rows if key in r]
    out[f"{name}_per_step"] = [_round(v, 8) for v in values]
    if missing:
        reasons.append(f"metric {key} is missing from metrics.jsonl (steps {missing})")
        return None
    if not all(math.isfinite(v) for v in values):
        reasons.append(f"metric {key} is not finite: {out[f'{name}_per_step']}")
        return None
    return values


def check_judge(rows: list[dict], out: dict, reasons: list[str], **_) -> None:
    """The judge scored every sample of every step, within the sigmoid's range."""
    values = _per_step(rows, f"reward/{JUDGE}", out, "judge_reward", reasons)
    if values is not None and not all(0.0 <= v <= 1.0 for v in values):
        reasons.append(f"reward/{JUDGE} outside [0, 1] (a sigmoid head's range): {out['judge_reward_per_step']}")
    failed = _per_step(rows, f"reward/{JUDGE}_parse_fail_frac", out, "judge_unscored_frac", reasons)
    if failed is not None and max(failed) > 0:
        reasons.append(f"reward/{JUDGE}_parse_fail_frac={max(failed):g}: the judge returned no score for some "
                       f"samples (see the log's warnings)")
    timing = _per_step(rows, "timing/judge_s", out, "judge_s", reasons)
    out["judge_s"] = _round(timing[-1], 3) if timing else None  # the last step's scoring time


def check_lora(rows: list[dict], out: dict, reasons: list[str], *, steps: int, **_) -> None:
    """The adapter gets gradients, and a trained adapter's sync is checked (the mismatch from step 2)."""
    if steps < 2:
        reasons.append(f"--steps {steps}: the LoRA part needs at least 2 steps (step 1 samples from the initial "
                       f"adapter, which changes nothing; the first synced trained adapter is checked at step 2)")
    norms = _per_step(rows, "actor/grad_norm", out, "grad_norm", reasons)
    if norms is not None and not all(v > 0 for v in norms):
        reasons.append(f"actor/grad_norm is 0 on some step ({out['grad_norm_per_step']}): the adapter gets no gradient")


def check_moe_r3(rows: list[dict], out: dict, reasons: list[str], *, min_router_agreement: float, **_) -> None:
    """R3: vLLM's routed experts reached every training forward (none missing) and the trainer's own
    routers mostly agree with them (a wrong layer or expert mapping agrees at chance, 1/6 for top-2 of 4)."""
    agree = _per_step(rows, "actor/router_agreement", out, "router_agreement", reasons)
    out["router_agreement"] = _round(min(agree), 6) if agree else None
    out["min_router_agreement"] = min_router_agreement
    if agree is not None and min(agree) < min_router_agreement:
        reasons.append(f"actor/router_agreement={min(agree):.3g} < {min_router_agreement:g}: the trainer's routers "
                       f"disagree with the experts vLLM returned (wrong layer/expert mapping, or different weights)")
    missing = _per_step(rows, "actor/router_replay_missing", out, "router_replay_missing", reasons)
    if missing is not None and max(missing) > 0:
        reasons.append(f"actor/router_replay_missing={max(missing):g}: tokens without vLLM's routing in a training "
                       f"forward")


def check_moe(rows: list[dict], out: dict, reasons: list[str], **_) -> None:
    """The experts slept and woke every step (sleep level 2), and the rollout checked them after each
    wake-up: what vllm-ascend 0.23 swapped (4 for the tiny model's 2 layers) was put back; 0 on CUDA.
    ``experts_sync``: how the experts of the per-expert Qwen3-MoE checkpoint went into vLLM, as its
    loader takes them (``rollout/experts_fused``): "per-expert" on the NPU pin (vllm 0.23's Qwen3-MoE
    drops fused names), "fused" on CUDA (vllm 0.32); the first sync raises if vLLM dropped any."""
    restored = _per_step(rows, EXPERTS_RESTORED, out, "experts_restored", reasons)
    out["experts_restored"] = max(restored) if restored else None
    fused = _per_step(rows, "rollout/experts_fused", out, "experts_fused", reasons)
    out["experts_sync"] = None if not fused else ("fused" if min(fused) == 1 else "per-expert")


def check_ulysses(rows: list[dict], out: dict, reasons: list[str], **_) -> None:
    """The rows really went through the Ulysses path: ``perf/sp_pad_frac`` (padding to a multiple of U)
    logged every step, in [0, 1)."""
    pad = _per_step(rows, "perf/sp_pad_frac", out, "sp_pad_frac", reasons)
    if pad is not None and not all(0 <= p < 1 for p in pad):
        reasons.append(f"perf/sp_pad_frac={pad}: outside [0, 1)")


def check_teacher(rows: list[dict], out: dict, reasons: list[str], **_) -> None:
    """The teacher scored every step: ``distill/reverse_kl`` finite and ``timing/teacher_s`` logged."""
    _per_step(rows, "distill/reverse_kl", out, "reverse_kl", reasons)
    _per_step(rows, "timing/teacher_s", out, "teacher_s", reasons)


PART_CHECKS = {"judge": check_judge, "lora": check_lora, "moe": check_moe, "ulysses": check_ulysses,
               "teacher": check_teacher, "moe_r3": check_moe_r3}


def part_report(part: str, rows: list[dict], *, steps: int, max_logp_diff: float, min_router_agreement: float = 0.5,
                rc: int = 0, log: str | None = None) -> dict:
    """``report`` and the part's own checks (PART_CHECKS) on its rows."""
    out = report(rows, steps=steps, max_logp_diff=max_logp_diff, rc=rc, log=log)
    if rows and part in PART_CHECKS:
        PART_CHECKS[part](rows, out, out["reasons"], steps=steps, min_router_agreement=min_router_agreement)
        out["pass"] = not out["reasons"]
    return out


def overall(parts: dict[str, dict]) -> dict:
    """The whole check from each part's result ({"skipped": why} for a skipped one): passes when a
    part ran and every part that ran passed; reasons are "part: reason"."""
    ran = {name: p for name, p in parts.items() if "skipped" not in p}
    reasons = [f"{name}: {r}" for name, p in ran.items() for r in p["reasons"]]
    if not ran:
        reasons.append("no part ran (" + "; ".join(f"{n} skipped: {p['skipped']}" for n, p in parts.items()) + ")")
    return {"pass": not reasons, "reasons": reasons, "passed": [n for n, p in ran.items() if p["pass"]],
            "failed": [n for n, p in ran.items() if not p["pass"]],
            "skipped": [n for n, p in parts.items() if "skipped" in p]}


def _named(values: list[str], flag: str, ap) -> list[tuple[str, str]]:
    pairs = []
    for v in values:
        name, sep, rest = v.partition("=")
        if not sep or name not in PARTS:
            ap.error(f"{flag} {v!r}: give PART=VALUE with PART one of {', '.join(PARTS)}")
        pairs.append((name, rest))
    return pairs


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


def ascend_ops() -> str:
    """vllm-ascend's custom ops on this NPU: the wheel's device type against the SoC
    (``check_ascend_device_type``, vllm-ascend 0.23.0 vllm_ascend/utils.py:845-866), its op library
    (``enable_custom_op``, :409-467) and the routing op the unquantized experts call
    (``torch.ops._C_ascend.npu_moe_init_routing_custom``, device/device_op.py:103-126). "ok ..." or
    a line starting with ERROR that names the fix."""
    fix = ("PyPI's vllm-ascend wheels carry Atlas A2 (ascend910b) kernels only (their _build_info.py says "
           "A2): on an Atlas A3 use vllm-ascend's A3 image, or build it from source with SOC_VERSION="
           "ascend910_9391 (docs/install.md)")
    try:
        import torch
        import torch_npu
        from vllm_ascend import utils
    except Exception as e:  # noqa: BLE001  any import failure: no usable stack
        return f"ERROR importing torch_npu / vllm_ascend failed ({type(e).__name__}: {e}): install requirements-npu.txt"
    soc = torch_npu.npu.get_soc_version()
    try:
        utils.check_ascend_device_type()
    except (AssertionError, RuntimeError) as e:
        return f"ERROR vllm-ascend does not match this NPU (soc_version {soc}): {e}. {fix}"
    if not utils.enable_custom_op():
        return (f"ERROR vllm-ascend's custom op library (vllm_ascend.vllm_ascend_C) did not load on soc_version "
                f"{soc} (its log says why). {fix}")
    if not hasattr(torch.ops._C_ascend, "npu_moe_init_routing_custom"):
        return (f"ERROR vllm-ascend's op library loaded without npu_moe_init_routing_custom, which every "
                f"unquantized MoE layer calls. {fix}")
    return f"ok: custom ops load on soc_version {soc} ({utils.get_ascend_device_type()})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probe", choices=["cuda", "npu"], help="print the visible device count and exit")
    ap.add_argument("--ascend-ops", nargs="?", const="", default=None, metavar="VERDICT",
                    help="alone: check vllm-ascend's custom ops on this NPU and exit; with a value (gpu_check.sh "
                         "passes the check's line): put it in the JSON line")
    ap.add_argument("--out", help="gpu_check.sh's OUT: part P's run in OUT/P/run, its log OUT/P/train.log")
    ap.add_argument("--ran", action="append", default=[], metavar="PART=RC", help="a part that ran and the "
                    "trainer's exit code (in the order run)")
    ap.add_argument("--skipped", action="append", default=[], metavar="PART=REASON", help="a part not run, and why")
    ap.add_argument("--run-dir", help="one run's trainer.output_dir (holds metrics.jsonl), instead of --out")
    ap.add_argument("--part", choices=PARTS, default="base", help="with --run-dir: the part's checks to apply")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-logp-diff", type=float, default=1e-3)
    ap.add_argument("--min-router-agreement", type=float, default=0.5)
    ap.add_argument("--rc", type=int, default=0, help="with --run-dir: the trainer's exit code")
    ap.add_argument("--log", help="with --run-dir: the trainer's log file (named in the reasons)")
    ap.add_argument("--device")
    ap.add_argument("--nproc", type=int)
    ap.add_argument("--tp", type=int)
    args = ap.parse_args(argv)
    if args.probe:
        print(probe(args.probe))
        return 0
    if args.ascend_ops == "":
        print(ascend_ops())
        return 0
    if bool(args.run_dir) == bool(args.out):
        ap.error("give --out (every part of a gpu_check.sh run) or --run-dir (one run)")
    limits = {"steps": args.steps, "max_logp_diff": args.max_logp_diff,
              "min_router_agreement": args.min_router_agreement}
    extra = {k: v for k, v in (("device", args.device), ("nproc", args.nproc), ("tp", args.tp),
                               ("ascend_custom_ops", args.ascend_ops)) if v is not None}
    if args.run_dir:
        result = part_report(args.part, read_rows(args.run_dir), rc=args.rc, log=args.log, **limits)
        head = {"check": "gpu_check", "pass": result.pop("pass")}
        print(json.dumps({**head, **result, **extra, "run_dir": args.run_dir}), flush=True)
        return 0 if head["pass"] else 1
    if not args.ran and not args.skipped:
        ap.error("name the parts: --ran PART=RC for each part that ran, --skipped PART=REASON for each skipped one")
    parts: dict[str, dict] = {}
    for name, rc in _named(args.ran, "--ran", ap):
        if not rc.lstrip("-").isdigit():
            ap.error(f"--ran {name}={rc}: the exit code must be an integer")
        run_dir, log = os.path.join(args.out, name, "run"), os.path.join(args.out, name, "train.log")
        parts[name] = {**part_report(name, read_rows(run_dir), rc=int(rc), log=log, **limits),
                       "run_dir": run_dir, "log": log}
    for name, reason in _named(args.skipped, "--skipped", ap):
        parts[name] = {"pass": None, "skipped": reason}
    parts = {name: parts[name] for name in PARTS if name in parts}  # in gpu_check.sh's default order
    verdict = overall(parts)
    print(json.dumps({"check": "gpu_check", **verdict, "parts": parts, **extra, "out": args.out}), flush=True)
    return 0 if verdict["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
