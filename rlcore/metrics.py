"""Metrics sinks on rank 0: one JSON object per step in metrics.jsonl, a readable console line, and
the trackers named by logging.trackers (``rlcore.trackers``: TensorBoard, wandb, MLflow, ...). Other
ranks construct the logger too but write nothing.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import sys
import time
from collections import deque
from contextlib import contextmanager
from typing import Any

from rlcore.trackers import get_tracker


CONSOLE_KEYS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("actor/pg_loss", "pg_loss", "{:+.4f}"),
    ("actor/kl", "kl", "{:.4f}"),
    ("actor/entropy", "ent", "{:.3f}"),
    ("actor/grad_norm", "gnorm", "{:.3f}"),
    ("rollout/response_len_mean", "len", "{:.1f}"),
    ("timing/step_s", "step_s", "{:.2f}"),
)


class MetricsLogger:
    """``trackers``: names in ``rlcore.trackers.TRACKERS`` (None = ["tensorboard"] when ``tensorboard``,
    else none); ``options``: the logging section the trackers read their settings from (e.g. its
    ``wandb``); ``run_config``: the resolved Config (or a dict), handed to each tracker once."""

    def __init__(self, output_dir: str, is_main: bool, tensorboard: bool = True, console_every: int = 1,
                 total_steps: int | None = None, *, trackers: list[str] | None = None, options: Any = None,
                 run_config: Any = None):
        self.is_main, self.console_every, self.total_steps = is_main, console_every, total_steps
        self.step_times: deque[float] = deque(maxlen=10)  # recent timing/step_s, for the ETA
        self.jsonl, self.trackers = None, {}
        names = list(trackers) if trackers is not None else ["tensorboard"] if tensorboard else []
        classes = [get_tracker(name) for name in names]  # an unknown name fails on every rank
        if not is_main:
            return
        os.makedirs(output_dir, exist_ok=True)
        for name, cls in zip(names, classes):
            self.trackers[name] = cls(output_dir, options, run_config)
        if self.trackers:
            atexit.register(self.close)  # exits that skip teardown (exit 3, a crash) still close the trackers
        # Appending keeps the rows of earlier (resumed) segments of the same run.
        self.jsonl = open(os.path.join(output_dir, "metrics.jsonl"), "a")

    @property
    def writer(self):
        """The TensorBoard SummaryWriter, or None (rlcore.run.checkpoint.purge_tensorboard uses it)."""
        tb = self.trackers.get("tensorboard")
        return getattr(tb, "writer", None)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.is_main:
            return
        clean = {k: float(v) for k, v in sorted(metrics.items())}
        row = {"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in clean.items()}}
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        finite = {k: v for k, v in clean.items() if math.isfinite(v)}  # metrics.jsonl keeps nan/inf as text
        for tracker in self.trackers.values():
            tracker.log(step, finite)
        if "timing/step_s" in clean:
            self.step_times.append(clean["timing/step_s"])
        if step % self.console_every == 0 and any(key in clean for key, _, _ in CONSOLE_KEYS):
            print(format_console(step, clean, self.total_steps, self.eta_s(step)), flush=True)

    def eta_s(self, step: int) -> float | None:
        """Seconds left at the median of the recent step times (validation and saves not included)."""
        if not self.total_steps or not self.step_times:
            return None
        recent = sorted(self.step_times)
        return recent[len(recent) // 2] * max(self.total_steps - step, 0)

    def close(self) -> None:
        """Closes every tracker once (a second call does nothing)."""
        trackers, self.trackers = self.trackers, {}
        for name, tracker in trackers.items():
            try:
                tracker.close()
            except Exception as e:  # the others (and metrics.jsonl) still close
                print(f"warning: closing the {name} tracker failed: {type(e).__name__}: {e}", file=sys.stderr,
                      flush=True)
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None


def format_console(step: int, metrics: dict[str, float], total_steps: int | None = None,
                   eta_s: float | None = None) -> str:
    width = len(str(total_steps)) if total_steps else 5
    parts = [f"step {step:>{width}}/{total_steps}" if total_steps else f"step {step:>5}"]
    for key, short, fmt in CONSOLE_KEYS:
        if key in metrics:
            parts.append(f"{short} {fmt.format(metrics[key])}")
    if eta_s is not None:
        parts.append(f"eta {format_duration(eta_s)}")
    return " | ".join(parts)


def format_duration(seconds: float) -> str:
    """3h05m, 4m10s or 12s."""
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Timer:
    """Accumulates wall time per phase name: ``with timer("generate"): ...`` -> timing/generate_s."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        """Time measured elsewhere (e.g. the tools' share inside generate)."""
        self.times[name] = self.times.get(name, 0.0) + seconds

    def pop_metrics(self) -> dict[str, float]:
        out = {f"timing/{k}_s": v for k, v in self.times.items()}
        self.times = {}
        return out
