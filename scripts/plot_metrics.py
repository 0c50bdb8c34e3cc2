"""Draw PNG training curves from a run's metrics.jsonl: reward, accuracy (train and validation),
KL, entropy, response length and step time, one panel each (panels without data are left out).

    python scripts/plot_metrics.py outputs/smollm2_arith            -> outputs/smollm2_arith/curves.png
    python scripts/plot_metrics.py outputs/run/metrics.jsonl --out curves.png --smooth 5
    python scripts/plot_metrics.py runs/a runs/b --keys rollout/mismatch_max,reward/mean --out ab.png

Several runs: their curves side by side in each panel, labelled by folder name. ``--keys``: one
panel per listed metric instead of the default panels.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

# (title, [(metrics key, label)]): validation keys are drawn with markers (they are sparse).
PANELS = [
    ("reward", [("reward/mean", "train reward/mean"), ("val/reward_mean", "val reward_mean")]),
    ("accuracy", [("reward/accuracy", "train (sampled)"), ("val/accuracy", "val greedy pass@1")]),
    ("KL to reference", [("actor/kl", "actor/kl")]),
    ("entropy", [("actor/entropy", "actor/entropy")]),
    ("response length (tokens)", [("rollout/response_len_mean", "train"), ("val/response_len_mean", "val")]),
    ("tool calls per sample", [("rollout/tool_calls_mean", "train"), ("val/tool_calls_mean", "val greedy")]),
    ("step time (s)", [("timing/step_s", "timing/step_s")]),
]


def read_rows(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"error: {path}:{lineno} is not valid JSON ({e.msg})")
    return rows


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows holding a finite ``key``; the last row wins for a repeated step."""
    by_step = {}
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value) and "step" in row:
            by_step[row["step"]] = float(value)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points (1 = unchanged)."""
    if window <= 1:
        return values
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(runs: list[tuple[str, list[dict]]], out: str, window: int, title: str,
         keys: list[str] | None = None) -> list[str]:
    """Write the PNG of ``runs`` ((name, rows) each; one run: no name in the labels); returns
    the panel titles drawn."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    layout = PANELS if not keys else [(k, [(k, k)]) for k in keys]
    named = lambda run, lbl: lbl if len(runs) == 1 else f"{run}: {lbl}"  # noqa: E731
    panels = [(t, [(k, named(run, lbl), *series(rows, k)) for run, rows in runs for k, lbl in pairs])
              for t, pairs in layout]
    panels = [(t, [c for c in curves if c[2]]) for t, curves in panels]
    panels = [(t, curves) for t, curves in panels if curves]
    if not panels:
        sys.exit("error: the metrics file holds none of the plotted keys")
    cols = 3 if len(panels) > 4 else 2
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.4 * nrows), squeeze=False)
    for ax, (panel_title, curves) in zip(axes.flat, panels):
        for key, label, steps, values in curves:
            if key.startswith("val/"):
                ax.plot(steps, values, marker="o", label=label)
            else:
                ax.plot(steps, smooth(values, window), label=label)
        ax.set_title(panel_title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(curves) > 1 or len(runs) > 1:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return [t for t, _ in panels]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metrics", nargs="+", help="a run's output_dir or its metrics.jsonl (several: side by side)")
    ap.add_argument("--out", default=None, help="PNG path (default: curves.png next to metrics.jsonl)")
    ap.add_argument("--smooth", type=int, default=1, help="moving-average window for training curves")
    ap.add_argument("--title", default=None)
    ap.add_argument("--keys", default=None, help="comma-separated metrics, one panel each (default: the usual panels)")
    args = ap.parse_args(argv)
    runs = []
    for given in args.metrics:
        path = os.path.join(given, "metrics.jsonl") if os.path.isdir(given) else given
        if not os.path.isfile(path):
            sys.exit(f"error: {path} does not exist; pass a run's output_dir or its metrics.jsonl")
        runs.append((os.path.basename(os.path.dirname(os.path.abspath(path))), read_rows(path)))
    out = args.out or os.path.join(os.path.dirname(path) or ".", "curves.png")
    keys = [k.strip() for k in args.keys.split(",") if k.strip()] if args.keys else None
    drawn = plot(runs, out, args.smooth, args.title or os.path.dirname(os.path.abspath(path)), keys)
    print(f"wrote {out} ({', '.join(drawn)}; {sum(len(rows) for _, rows in runs)} rows)")


if __name__ == "__main__":
    main()
