"""Per-call start-up cost of each python-tool sandbox backend (rlcore/agent/sandbox*.py): the
median and 90th percentile wall time of N calls of ``print(1)`` per backend, side by side in one
run, one call at a time, each without and with its control group (``cgroup: off`` / ``auto``,
where this machine lets the trainer make one). ``process`` without a group is the plain child
process of earlier versions: the reference.

    .venv/bin/python scripts/bench_sandbox.py [--calls 20] [--python /usr/bin/python3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--python", default=None, help="interpreter for the uid backend (one every uid can read)")
    args = ap.parse_args()
    from rlcore.agent import sandbox_cgroup
    from rlcore.agent.sandbox import LOCAL, Limits, run_python, why_not

    place, how = sandbox_cgroup.probe()
    print(f"control groups: {how}")
    print(f"{'backend':<12}{'cgroup':>7}{'median ms':>10}{'p90 ms':>9}{'vs process':>12}  notes")
    base = None
    runs = [(b, cg) for b in reversed(LOCAL) for cg in (["off", "auto"] if place else ["off"])]
    for backend, cgroup in runs:  # process without a group first: the reference
        python = args.python if backend == "uid" else None
        why = why_not(backend, python) if backend != "process" else None
        if why:
            print(f"{backend:<12}{cgroup:>7}{'-':>10}{'-':>9}{'-':>12}  unavailable: {why[:90]}")
            continue
        limits = Limits(timeout_s=30, backend=backend, python=python, cgroup=cgroup)
        run_python("print(1)", limits)  # warm the page cache and the probes
        times = []
        for _ in range(args.calls):
            start = time.perf_counter()
            result = run_python("print(1)", limits)
            times.append((time.perf_counter() - start) * 1000)
            assert result.ok and result.output == "1\n", result
        med, p90 = statistics.median(times), sorted(times)[int(0.9 * (len(times) - 1))]
        base = base or med
        print(f"{backend:<12}{cgroup:>7}{med:>10.1f}{p90:>9.1f}{med - base:>+11.1f}   {len(times)} calls")


if __name__ == "__main__":
    main()
