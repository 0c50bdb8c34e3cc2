"""Benchmark: what one trainer launch costs before its first step, and what the collector's share is.

    .venv/bin/python scripts/bench_startup.py [--runs 3] [--steps 2] [--nproc 2]

Most of a short launch is start-up (a 2-step run of the tiny demo spends well over nine tenths of
its CPU before its first step): the stack's imports, the vLLM engine, the VeOmni model. rlcore
keeps the cyclic collector off the imports' heap (rlcore/heap.py). This script shows why, with
three side-by-side measurements on this machine:

1. ``imports``: CPU seconds of a fresh interpreter importing torch, transformers, vLLM's ``LLM``
   and VeOmni, with the collector on and off (median of ``--runs``, alternating);
2. ``collect``: one full ``gc.collect()`` after those imports, then again after ``gc.freeze()``;
3. ``launch``: the same 2-step demo launch under torchrun, as it is and with the collector as it
   was before rlcore.heap (a wrapper makes ``gc.disable``, ``heap.freeze`` and ``heap.settle``
   no-ops; vLLM's own freeze at the end of its start-up stays): wall seconds and the CPU seconds of
   the launcher and its ranks, alternating, medians and their ratio.

Prints one line per measurement and, last, a JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts import bench_common as bc  # noqa: E402

STACK = "import torch, transformers; from transformers import AutoTokenizer; from vllm import LLM; import veomni"
IMPORT_CPU = f"""
import gc, resource, sys
if sys.argv[1] == "off":
    gc.disable()
{STACK}
u = resource.getrusage(resource.RUSAGE_SELF)
print(u.ru_utime + u.ru_stime)
"""
COLLECT = f"""
import gc, json, time
{STACK}
t = time.perf_counter(); gc.collect(); full = time.perf_counter() - t
objects = len(gc.get_objects())
gc.freeze()
t = time.perf_counter(); gc.collect(); frozen = time.perf_counter() - t
print(json.dumps({{"objects": objects, "collect_s": full, "collect_frozen_s": frozen}}))
"""
# The collector as it was before rlcore.heap: on from the start, nothing frozen by rlcore.
AS_BEFORE = """
import gc, runpy, sys
gc.disable = lambda: None
from rlcore import heap
heap.freeze = heap.settle = lambda: None
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_python(code: str, *args: str) -> str:
    env = {**os.environ, **bc.QUIET_ENV, "PYTHONPATH": bc.REPO}
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=bc.REPO, env=env, capture_output=True,
                          text=True, check=True)
    return proc.stdout.strip().splitlines()[-1]


def launch(model: str, data: str, out: str, steps: int, nproc: int, as_before: bool) -> tuple[float, float]:
    """One demo launch: (wall s, CPU s of torchrun and its ranks)."""
    train = os.path.join(bc.REPO, "train_grpo.py")
    script = [train]
    if as_before:
        wrapper = out + "_wrapper.py"
        with open(wrapper, "w") as f:
            f.write(AS_BEFORE)
        script = [wrapper, train]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *script,
           "--config", os.path.join(bc.REPO, "configs", "demo_cpu.yaml"), "--model.path", model,
           "--data.train_files", json.dumps([data]), "--data.val_files", "[]", "--trainer.output_dir", out,
           "--trainer.total_steps", str(steps), "--trainer.prompts_per_step", "4", "--rollout.n", "4"]
    env = {**os.environ, **bc.QUIET_ENV, "PYTHONPATH": bc.REPO, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    cpu0, t0 = child_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=bc.REPO, env=env, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, child_cpu() - cpu0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"the launch exited {proc.returncode}")
    return wall, cpu


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3, help="repetitions of each side (alternating)")
    p.add_argument("--steps", type=int, default=2, help="training steps of each launch")
    p.add_argument("--nproc", type=int, default=2, help="ranks of each launch")
    return p.parse_args(argv)


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    from rlcore.demo.toy import make_tiny_model, make_toy_data

    result: dict = {"runs": args.runs, "steps": args.steps, "nproc": args.nproc}
    on, off = [], []
    for _ in range(args.runs):
        on.append(float(run_python(IMPORT_CPU, "on")))
        off.append(float(run_python(IMPORT_CPU, "off")))
    result["imports"] = {"cpu_s_collector_on": statistics.median(on), "cpu_s_collector_off": statistics.median(off)}
    print(f"imports: {result['imports']['cpu_s_collector_on']:.2f} s CPU with the collector on, "
          f"{result['imports']['cpu_s_collector_off']:.2f} s off", flush=True)
    result["collect"] = json.loads(run_python(COLLECT))
    c = result["collect"]
    print(f"collect: {c['collect_s']:.3f} s over {c['objects']} objects after the imports, "
          f"{c['collect_frozen_s'] * 1e6:.0f} us after gc.freeze()", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        model = make_tiny_model(os.path.join(tmp, "model"))
        data, _ = make_toy_data(os.path.join(tmp, "data"), n_train=64, n_val=8)
        sides: dict[str, list[tuple[float, float]]] = {"as_is": [], "as_before": []}
        for i in range(args.runs):
            for side in sides:
                out = os.path.join(tmp, f"{side}_{i}")
                sides[side].append(launch(model, data, out, args.steps, args.nproc, side == "as_before"))
                print(f"launch {side} {i + 1}/{args.runs}: {sides[side][-1][0]:.1f} s wall, "
                      f"{sides[side][-1][1]:.1f} s CPU", flush=True)
    for side, runs in sides.items():
        result[f"launch_{side}"] = {"wall_s": statistics.median(w for w, _ in runs),
                                    "cpu_s": statistics.median(c for _, c in runs)}
    a, b = result["launch_as_is"], result["launch_as_before"]
    result["launch_wall_ratio"] = a["wall_s"] / b["wall_s"]
    result["launch_cpu_ratio"] = a["cpu_s"] / b["cpu_s"]
    print(f"launch: {a['wall_s']:.1f} s wall / {a['cpu_s']:.1f} s CPU as it is, {b['wall_s']:.1f} / "
          f"{b['cpu_s']:.1f} with the collector as before: ratios {result['launch_wall_ratio']:.2f} wall, "
          f"{result['launch_cpu_ratio']:.2f} CPU", flush=True)
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
