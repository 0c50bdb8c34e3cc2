"""Shared plumbing of the benchmark scripts: start the script's own ranks under torchrun, pass
the rank-0 result back, measure process memory, take medians.

A benchmark run as ``.venv/bin/python scripts/bench_X.py ARGS`` re-launches itself as
``python -m torch.distributed.run --standalone --nproc_per_node=N scripts/bench_X.py`` (ARGS in
the environment, see ``run_or_relaunch``) with a result file; rank 0 writes a JSON object there, and the launcher prints the ranks'
``bench:`` progress lines and then that object as the last line of its output.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUIET_ENV = {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR",
    "VEOMNI_VERBOSITY": "ERROR", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}
RESULT_ENV = "BENCH_RESULT_FILE"
ARGV_ENV = "BENCH_ARGV"


def under_torchrun() -> bool:
    return RESULT_ENV in os.environ and "LOCAL_RANK" in os.environ


def run_or_relaunch(script: str, argv: list[str], parse_args, worker) -> dict | None:
    """A benchmark's entry point. In a rank: ``worker(args)``, returns None. Otherwise: start
    ``script`` on ``args.nproc`` ranks and return rank 0's result. The arguments travel to the
    ranks in the environment: torchrun's parser would take a script option that prefixes one of
    its own (``--n``, ``--nproc``) as an ambiguous abbreviation and refuse to start."""
    if under_torchrun():
        worker(parse_args(json.loads(os.environ[ARGV_ENV])))
        return None
    args = parse_args(argv)
    return relaunch(script, argv, args.nproc, args.timeout_s)


def relaunch(script: str, argv: list[str], nproc: int, timeout_s: float) -> dict:
    """Run ``script argv`` on ``nproc`` CPU ranks; stream its ``bench:`` lines; return rank 0's
    result. On failure print the tail of the output and exit with the launcher's code."""
    fd, result = tempfile.mkstemp(prefix="bench_", suffix=".json")
    os.close(fd)
    env = {**os.environ, **QUIET_ENV, RESULT_ENV: result, ARGV_ENV: json.dumps(argv), "PYTHONPATH": REPO,
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           script]
    lines: list[str] = []
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("bench:"):
                print(line[len("bench:"):].strip(), flush=True)
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    if proc.returncode != 0 or os.path.getsize(result) == 0:
        sys.stderr.write("".join(lines[-80:]))
        sys.stderr.write(f"\nbenchmark ranks exited with code {proc.returncode}\n")
        raise SystemExit(proc.returncode or 1)
    with open(result) as f:
        out = json.load(f)
    os.unlink(result)
    return out


def write_result(result: dict) -> None:
    with open(os.environ[RESULT_ENV], "w") as f:
        json.dump(result, f)


def say(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"bench: {msg}", flush=True)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


# ----------------------------------------------------------------------------- process memory


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def reset_peak_rss() -> bool:
    """Reset VmHWM (Linux: writing 5 to clear_refs); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def cpu_timed(timer) -> None:
    """Make the trainer's ``rlcore.metrics.Timer`` also sum this process's CPU time per name (in
    ``timer.cpu``): on a shared, overloaded host wall time also measures waiting for a core, CPU
    time the work. Changes the object in place, as the sampler and the phase switch hold it."""
    from contextlib import contextmanager

    from rlcore.metrics import Timer

    class CpuTimer(Timer):
        @contextmanager
        def __call__(self, name):
            start = time.process_time()
            try:
                with Timer.__call__(self, name):
                    yield
            finally:
                self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - start

    timer.__class__, timer.cpu = CpuTimer, {}


# ----------------------------------------------------------------------------- CPU time


def process_tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and of its descendants alive now, plus what their
    reaped children used (Linux /proc; 0.0 for a process gone meanwhile)."""
    total, stack = 0.0, [pid]
    tick = os.sysconf("SC_CLK_TCK")
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except (OSError, ValueError):
            continue
        # fields[0] is the state (field 3): utime, stime, cutime, cstime are fields 14-17
        total += sum(int(x) for x in fields[11:15]) / tick
        stack.extend(kids)
    return total
