"""Learning per minute: train the SmolLM2 example for a fixed budget of training time under
several settings, one run after the other, and compare held-out accuracy against time.

    .venv/bin/python scripts/bench_learning.py --budget-min 34 \
        --run before="--algorithm.oversample false" --run after="--exploration.entropy_target 0.3" \
        [--config configs/smollm2_arith_cpu.yaml] [--common "--rollout.max_response_length 24"] \
        [--val-every 5] [--val-samples 200] [--nproc 2] [--out outputs/bench_learning] \
        [--breakdown op,carries --val-file data/word99c/arith_val.jsonl]
    .venv/bin/python scripts/bench_learning.py --report-only --run before= --run after=   (re-read the logs)

Each run is ``train_grpo.py`` under torchrun with the config, the --common overrides, its own
overrides, validation every --val-every steps on the first --val-samples held-out prompts (greedy,
as the example's validation) and no checkpoints. The budget counts training time only (the sum of
``timing/step_s``: generation, scoring, training, weight sync), not start-up or validation, so a
setting that validates more often is not penalised. A run stops at the first validation at or
after its budget; its last accuracy is therefore measured at the budget or up to --val-every steps
past it (the table gives the exact minutes).

Prints per run a table of the validations (step, training minutes, accuracy, entropy, zero-variance
fraction and generated samples per trained sample over the steps since the previous validation),
then one summary table side by side, then writes ``<out>/learning.png`` and ``<out>/summary.json``.
``last_third_rise`` in the summary is the least-squares accuracy rise over the last third of the
budget (the plateau test: a plateau fits about 0; one validation on 200 problems is +-0.035).
``--breakdown FIELDS`` adds, per validation, the greedy accuracy for each value of those fields of the
validation rows (``op``: add / sub; ``op,carries`` with ``make_arith_data.py --with-carries``), which
shows which problems a plateau is made of. Every run writes all its greedy validation rows
(``val/step_N.jsonl``) for that; the join is by prompt, so the --val-file may be a copy of the runs'
validation file with extra fields.
Runs are sequential on purpose: two runs sharing the cores would time each other.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from scripts.bench_common import QUIET_ENV  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", required=True, metavar="NAME=OVERRIDES",
                   help="a run: its name and its train_grpo.py overrides (repeat; run in this order)")
    p.add_argument("--config", default="configs/smollm2_arith_cpu.yaml")
    p.add_argument("--common", default="", help="overrides every run gets (before its own)")
    p.add_argument("--budget-min", type=float, default=34.0, help="training minutes per run")
    p.add_argument("--val-every", type=int, default=5)
    p.add_argument("--val-samples", type=int, default=200)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", default="outputs/bench_learning")
    p.add_argument("--breakdown", metavar="FIELDS",
                   help="comma-separated fields of --val-file's rows: accuracy per value (e.g. op,carries)")
    p.add_argument("--val-file", help="the validation JSONL the runs use (with --breakdown)")
    p.add_argument("--report-only", action="store_true", help="only summarise the runs' metrics already in --out")
    args = p.parse_args(argv)
    if args.breakdown and not args.val_file:
        p.error(f"--breakdown {args.breakdown}: also give --val-file, the validation JSONL whose rows carry that field")
    args.runs = []
    for spec in args.run:
        name, sep, overrides = spec.partition("=")
        if not sep or not name or "/" in name:
            p.error(f"--run {spec!r}: write NAME=OVERRIDES, e.g. --run before='--algorithm.oversample false'")
        args.runs.append((name, shlex.split(overrides)))
    return args


def read_rows(out_dir: str) -> list[dict]:
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip().endswith("}")]


def train_minutes(rows: list[dict]) -> dict[int, float]:
    """Cumulative training minutes at the end of each step."""
    total, out = 0.0, {0: 0.0}
    for r in rows:
        if "timing/step_s" in r:
            total += r["timing/step_s"]
            out[r["step"]] = total / 60
    return out


def budget_reached(rows: list[dict], budget_min: float) -> bool:
    """The budget is spent and a validation at or after the step that spent it has been logged."""
    minutes = train_minutes(rows)
    spent = [s for s, m in minutes.items() if m >= budget_min]
    return bool(spent) and any("val/accuracy" in r and r["step"] >= min(spent) for r in rows)


def launch(args, name: str, overrides: list[str]) -> None:
    out = os.path.join(args.out, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "train_grpo.py", "--config", args.config, "--trainer.output_dir", out, "--trainer.total_steps", "100000",
           "--trainer.val_every", str(args.val_every), "--trainer.val_before_train", "true",
           "--val.max_samples", str(args.val_samples), "--val.num_examples", str(args.val_samples),
           "--checkpoint.save_every", "0", "--checkpoint.hf_every", "0",
           "--checkpoint.save_hf_final", "false", "--checkpoint.resume", "never",
           *shlex.split(args.common), *overrides]
    env = {**os.environ, **QUIET_ENV, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    print(f"[{name}] {' '.join(cmd[3:])}", flush=True)
    with open(os.path.join(out, "train.log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + args.budget_min * 60 * 3 + 900
        while proc.poll() is None and time.time() < deadline:
            time.sleep(5)
            if budget_reached(read_rows(out), args.budget_min):
                break
        if proc.poll() is None:  # budget spent (or the deadline): end the whole launcher's group
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        elif not budget_reached(read_rows(out), args.budget_min):
            sys.exit(f"[{name}] train_grpo.py exited {proc.returncode} before its budget; see {out}/train.log")
    time.sleep(3)  # the ranks die with their launcher (PDEATHSIG): let them go before the next run


def window_mean(rows: list[dict], key: str, lo: int, hi: int) -> float:
    values = [r[key] for r in rows if key in r and lo < r["step"] <= hi and "timing/step_s" in r]
    return statistics.fmean(values) if values else float("nan")


def last_third_rise(table: list[dict], budget_min: float) -> float | None:
    """Least-squares accuracy rise over the last third of the budget: the fitted slope against
    training minutes, times the minutes it spans, over the last validation at or before two thirds
    and every one after. A fit, not last-minus-anchor, so one lucky validation cannot make a
    plateau look like a rise. Compare it with one validation's binomial noise, sqrt(p(1-p)/n):
    0.035 at p = 0.5 on 200 problems."""
    anchor = [t for t in table if t["train_min"] <= budget_min * 2 / 3]
    points = anchor[-1:] + [t for t in table if t["train_min"] > budget_min * 2 / 3]
    if len(points) < 2:
        return None
    xs, ys = [t["train_min"] for t in points], [t["accuracy"] for t in points]
    slope = statistics.linear_regression(xs, ys).slope
    return slope * (xs[-1] - xs[0])


def summarise(name: str, rows: list[dict], budget_min: float) -> dict:
    minutes = train_minutes(rows)
    steps = [r for r in rows if "timing/step_s" in r]
    vals = [r for r in rows if "val/accuracy" in r]
    table, prev = [], 0
    for v in vals:
        s = v["step"]
        table.append({"step": s, "train_min": round(minutes.get(s, 0.0), 2), "accuracy": v["val/accuracy"],
                      "entropy": window_mean(rows, "actor/entropy", prev, s),
                      "reward": window_mean(rows, "reward/mean", prev, s),
                      "zero_var_frac": window_mean(rows, "rollout/zero_variance_groups_frac", prev, s),
                      "gen_per_trained": window_mean(rows, "rollout/generated_per_trained", prev, s)})
        prev = s
    trained = sum(r["rollout/tokens"] / max(r["rollout/response_len_mean"], 1e-9) for r in steps)
    gen_s = sum(r.get("timing/generate_s", 0.0) for r in steps)
    last = table[-1] if table else {}
    third = [t for t in table if t["train_min"] <= budget_min * 2 / 3]
    return {
        "name": name, "steps": len(steps), "train_min": round(minutes[max(minutes)], 2),
        "final_accuracy": last.get("accuracy"), "best_accuracy": max((t["accuracy"] for t in table), default=None),
        "accuracy_at_two_thirds": third[-1]["accuracy"] if third else None,
        "last_third_rise": last_third_rise(table, budget_min),
        "step_s_median": statistics.median(r["timing/step_s"] for r in steps) if steps else None,
        "generate_s_median": statistics.median(r.get("timing/generate_s", 0.0) for r in steps) if steps else None,
        "train_s_median": statistics.median(r.get("timing/train_s", 0.0) for r in steps) if steps else None,
        "generate_s_per_trained_sample": gen_s / max(trained, 1),
        "gen_per_trained_mean": window_mean(rows, "rollout/generated_per_trained", 0, 10**9),
        "sampling_rounds_mean": window_mean(rows, "rollout/sampling_rounds", 0, 10**9),
        "zero_var_frac_mean": window_mean(rows, "rollout/zero_variance_groups_frac", 0, 10**9),
        "final_entropy": last.get("entropy"), "final_reward": last.get("reward"), "validations": table,
        **tail_figures(rows, steps),
    }


# The long tail (rollout.partial, docs/partial_rollouts.md): per-step means of these metrics.
TAIL_KEYS = {"tail_decode_frac": "rollout/tail_decode_frac", "response_len_mean": "rollout/response_len_mean",
             "partial_frac": "rollout/partial_frac", "staleness_mean": "rollout/staleness_mean",
             "suspended_groups": "rollout/suspended_groups", "dropped_stale": "rollout/dropped_stale",
             "partial_len_bias": "rollout/partial_len_bias", "mismatch_kl": "rollout/mismatch_kl",
             "mismatch_kl_fresh": "rollout/mismatch_kl_fresh", "mismatch_kl_resumed": "rollout/mismatch_kl_resumed"}


def tail_figures(rows: list[dict], steps: list[dict]) -> dict:
    """Generated tokens per second of generate time (all steps together), the most stale token,
    and the TAIL_KEYS means: the tail's share of decode iterations, staleness, mismatch."""
    gen_s = sum(r.get("timing/generate_s", 0.0) for r in steps)
    out = {"gen_tokens_per_s": sum(r.get("rollout/tokens", 0.0) for r in steps) / max(gen_s, 1e-9),
           "staleness_max": max((r.get("rollout/staleness_max", 0.0) for r in steps), default=0.0)}
    out.update({k: window_mean(rows, key, 0, 10**9) for k, key in TAIL_KEYS.items()})
    return out


def field_accuracy(run_dir: str, val_file: str, fields: str) -> dict[int, dict[str, tuple[int, int]]]:
    """step -> {values of ``fields`` joined by "/": (correct, count)} over a run's greedy validation rows.
    A row is matched to its data row by the data prompt it contains (the logged prompt is the
    chat-templated one), so a prompt the data filter dropped cannot shift the join."""
    with open(val_file) as f:
        data = [json.loads(line) for line in f if line.strip()]
    names = fields.split(",")
    by_prompt = {d["prompt"]: "/".join(str(d.get(k)) for k in names) for d in data}
    out = {}
    val_dir = os.path.join(run_dir, "val")
    for name in sorted(os.listdir(val_dir)) if os.path.isdir(val_dir) else []:
        with open(os.path.join(val_dir, name)) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        counts: dict[str, tuple[int, int]] = {}
        for r in rows:
            # the longest data prompt inside the logged one (a prompt may be a prefix of another)
            hits = [p for p in by_prompt if p in r["prompt"]]
            value = by_prompt[max(hits, key=len)] if hits else "?"
            c, n = counts.get(value, (0, 0))
            counts[value] = (c + bool(r["correct"]), n + 1)
        if rows:
            out[rows[0]["step"]] = dict(sorted(counts.items()))
    return out


def print_tables(results: list[dict]) -> None:
    for r in results:
        print(f"\n== {r['name']}: {r['steps']} steps in {r['train_min']} training minutes")
        print(f"{'step':>5} {'min':>6} {'acc':>6} {'entropy':>8} {'reward':>7} {'zero_var':>8} {'gen/train':>9}")
        for t in r["validations"]:
            parts = "".join(f"  {k} {c}/{n}" for k, (c, n) in t.get("by_field", {}).items())
            print(f"{t['step']:>5} {t['train_min']:>6.1f} {t['accuracy']:>6.3f} {t['entropy']:>8.3f} "
                  f"{t['reward']:>7.3f} {t['zero_var_frac']:>8.3f} {t['gen_per_trained']:>9.2f}{parts}")
    keys = ["steps", "final_accuracy", "accuracy_at_two_thirds", "last_third_rise", "best_accuracy",
            "final_entropy", "final_reward",
            "step_s_median", "generate_s_median", "train_s_median", "generate_s_per_trained_sample",
            "gen_per_trained_mean", "sampling_rounds_mean", "zero_var_frac_mean", "gen_tokens_per_s",
            *TAIL_KEYS, "staleness_max"]
    print("\n" + f"{'':34}" + "".join(f"{r['name']:>14}" for r in results))
    for k in keys:
        cells = "".join(f"{r.get(k):>14.4g}" if isinstance(r.get(k), (int, float)) else f"{'-':>14}" for r in results)
        print(f"{k:34}{cells}")


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for r in results:
        v = r["validations"]
        axes[0].plot([t["train_min"] for t in v], [t["accuracy"] for t in v], marker="o", label=r["name"])
        axes[1].plot([t["step"] for t in v], [t["entropy"] for t in v], marker=".", label=r["name"])
        axes[2].plot([t["step"] for t in v], [t["zero_var_frac"] for t in v], marker=".", label=r["name"])
    for ax, (x, y) in zip(axes, [("training minutes", "held-out accuracy (greedy)"), ("step", "actor/entropy"),
                                 ("step", "rollout/zero_variance_groups_frac")]):
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for name, overrides in args.runs:
        if not args.report_only:
            launch(args, name, overrides)
    results = [summarise(name, read_rows(os.path.join(args.out, name)), args.budget_min) for name, _ in args.runs]
    if args.breakdown:
        for r in results:
            per_step = field_accuracy(os.path.join(args.out, r["name"]), args.val_file, args.breakdown)
            for t in r["validations"]:
                t["by_field"] = per_step.get(t["step"], {})
    print_tables(results)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.join(args.out, "learning.png"))
    print(f"\nwrote {os.path.join(args.out, 'learning.png')} and {os.path.join(args.out, 'summary.json')}")


if __name__ == "__main__":
    main()
