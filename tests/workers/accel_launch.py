"""The tests/workers/accel_worker.py launch (2 CPU ranks, tp=2), run once per pytest session and
shared by tests/test_rollout_accel.py and tests/test_vllm_api.py (importable as
``workers.accel_launch``): a launch costs ~25 s on 2 cores."""

from __future__ import annotations

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import functools
import glob
import json
import os
import tempfile

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "accel_worker.py")
SHM_LEFT: dict[str, set[str]] = {}  # model_dir -> vLLM CPU shm files the launch left in /dev/shm


@functools.lru_cache(maxsize=None)
def accel_results(model_dir: str) -> tuple[dict, ...]:
    """Per-rank measurements of accel_worker.py for the tiny model at ``model_dir``."""
    from conftest import run_torchrun

    out = os.path.join(tempfile.mkdtemp(prefix="rlcore_accel_"), "result.json")
    before = set(glob.glob("/dev/shm/*cpushm*"))
    proc = run_torchrun(WORKER, 2, model_dir, out)
    SHM_LEFT[model_dir] = set(glob.glob("/dev/shm/*cpushm*")) - before
    assert os.path.exists(out), proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        return tuple(json.load(f)["ranks"])
