"""Run checkpoints: written into a temporary folder, renamed when complete, then the ``latest``
pointer updated; older ones pruned only after that. A half-written checkpoint is never loaded.

Layout: {output_dir}/checkpoints/step_{N}/ with the policy's DCP state (model, optimizer, LR
scheduler, trainer state) and rng_rank{r}.pt per rank; {output_dir}/checkpoints/latest.
"""

from __future__ import annotations

import os
import random
import re
import shutil

import numpy as np
import torch

from rlcore.dist import barrier

STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(policy, output_dir: str, step: int, trainer_state: dict, rank: int, keep_last: int) -> str:
    """Collective: every rank calls it. Returns the final checkpoint folder."""
    root = checkpoint_root(output_dir)
    final = os.path.join(root, f"step_{step}")
    tmp = os.path.join(root, f".tmp-step_{step}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    policy.save_checkpoint(tmp, extra_state={"trainer": trainer_state})
    # Our own state, so pickle is fine here (loaded with weights_only=False only from this folder).
    torch.save(rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
    barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_latest(root, f"step_{step}")
        _prune(root, keep_last)
    barrier()
    return final


def _write_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, ".latest.tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, "latest"))


def _prune(root: str, keep_last: int) -> None:
    steps = sorted((int(m.group(1)), d) for d in os.listdir(root) if (m := STEP_DIR.match(d)))
    for _, d in steps[:-keep_last]:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def find_resume(output_dir: str, resume: str) -> str | None:
    """The checkpoint folder to resume from: ``never`` -> None; ``auto`` -> latest complete or None."""
    if resume == "never":
        return None
    if resume != "auto":
        return resume
    root = checkpoint_root(output_dir)
    latest = os.path.join(root, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        path = os.path.join(root, f.read().strip())
    return path if os.path.isdir(path) else None


def load(policy, path: str, rank: int) -> dict:
    """Collective: restores the policy, optimizer, scheduler and this rank's RNG; returns trainer state."""
    extra = policy.load_checkpoint(path)
    rng_file = os.path.join(path, f"rng_rank{rank}.pt")
    if os.path.isfile(rng_file):
        set_rng_state(torch.load(rng_file, weights_only=False))
    return extra["trainer"]
