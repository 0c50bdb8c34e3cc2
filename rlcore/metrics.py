"""Metrics sinks on rank 0: one JSON object per step in metrics.jsonl, a readable console line, and
the trackers named by logging.trackers (``rlcore.trackers``: TensorBoard, wandb, MLflow, ...). Other
ranks construct the logger too but write nothing.

Every write is a ``rlcore.errors.writing``: a failing disk becomes a ``StorageError`` naming the
sink (recorded instead inside the run's deferred blocks, ``rlcore.run.storage``). A metrics.jsonl
row is whole or absent: it is appended with one ``write`` and cut back off if that fails; rows
stop at the first failed one.
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

from rlcore.errors import StorageError, pending, writing
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
        self.path, self.trackers = None, {}  # path: metrics.jsonl, appended row by row (append_line)
        names = list(trackers) if trackers is not None else ["tensorboard"] if tensorboard else []
        classes = [get_tracker(name) for name in names]  # an unknown name fails on every rank
        if not is_main:
            return
        self.path = os.path.join(output_dir, "metrics.jsonl")
        with writing("the run's output folder", output_dir):
            os.makedirs(output_dir, exist_ok=True)
        with writing("metrics.jsonl (its partial last row removed)", self.path):
            cut = cut_partial_row(self.path)
            if cut:
                print(f"metrics.jsonl: removed a partial last row ({cut} bytes), left by a write cut short (a full "
                      f"disk, a failing mount, a kill)", flush=True)
        for name, cls in zip(names, classes):
            with writing(f"the {name} tracker's files", output_dir):
                self.trackers[name] = cls(output_dir, options, run_config)
        if self.trackers:
            atexit.register(self.close)  # exits that skip teardown (exit 3, a crash) still close the trackers

    @property
    def writer(self):
        """The TensorBoard SummaryWriter, or None (rlcore.run.checkpoint.purge_tensorboard uses it)."""
        tb = self.trackers.get("tensorboard")
        return getattr(tb, "writer", None)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Every sink in turn, the console line last; a failed write is raised after the others
        were tried (or recorded, in a deferred block). No row follows a failed row."""
        if not self.is_main:
            return
        clean = {k: float(v) for k, v in sorted(metrics.items())}
        row = {"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in clean.items()}}
        failures = []
        if not pending():
            failures += _attempt(f"metrics.jsonl (the row of step {step})", self.path, append_line, self.path,
                                 json.dumps(row) + "\n")
        finite = {k: v for k, v in clean.items() if math.isfinite(v)}  # metrics.jsonl keeps nan/inf as text
        for name, tracker in self.trackers.items():
            failures += _attempt(f"the {name} tracker's files (step {step})", None, tracker.log, step, finite)
        if "timing/step_s" in clean:
            self.step_times.append(clean["timing/step_s"])
        if step % self.console_every == 0 and any(key in clean for key, _, _ in CONSOLE_KEYS):
            print(format_console(step, clean, self.total_steps, self.eta_s(step)), flush=True)
        if failures:
            raise failures[0]

    def eta_s(self, step: int) -> float | None:
        """Seconds left at the median of the recent step times (validation and saves not included)."""
        if not self.total_steps or not self.step_times:
            return None
        recent = sorted(self.step_times)
        return recent[len(recent) // 2] * max(self.total_steps - step, 0)

    def close(self, quiet: bool = False) -> None:
        """Closes every tracker once (a second call does nothing). ``quiet``: the run is ending on a
        failed write, whose message said what was lost; closing errors are not reported again."""
        trackers, self.trackers = self.trackers, {}
        for name, tracker in trackers.items():
            try:
                with writing(f"the {name} tracker's files (closing)"):
                    tracker.close()
            except Exception as e:  # the others still close
                if not quiet:
                    print(f"warning: closing the {name} tracker failed: {type(e).__name__}: {e}", file=sys.stderr,
                          flush=True)


def append_line(path: str, text: str) -> None:
    """Append ``text`` (one row and its newline) whole or not at all: one ``write`` on an
    O_APPEND descriptor, and on a failure (a full disk cuts a write short) the file cut back to
    its size before, which frees space and so works on a full disk. A partial row survives only
    where even that fails; the next run's logger removes it (``cut_partial_row``)."""
    data = memoryview(text.encode())
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        try:
            while data:
                data = data[os.write(fd, data):]
        except OSError:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass
            raise
    finally:
        os.close(fd)


def cut_partial_row(path: str) -> int:
    """Truncate ``path`` after its last newline (the rows after it are whole); bytes removed."""
    if not os.path.isfile(path):
        return 0
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        pos = end
        while pos > 0:
            step = min(65536, pos)
            f.seek(pos - step)
            chunk = f.read(step)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                pos = pos - step + newline + 1
                break
            pos -= step
        if pos < end:
            f.truncate(pos)
        return end - pos


def _attempt(what: str, path: str | None, fn, *args) -> list[StorageError]:
    """``fn(*args)`` as the write ``what``: [] when it worked (or its failure was recorded), else
    [the StorageError]."""
    try:
        with writing(what, path):
            fn(*args)
    except StorageError as e:
        return [e]
    return []


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
