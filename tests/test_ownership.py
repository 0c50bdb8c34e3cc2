"""A killed launcher takes its ranks with it, and two runs never write one output directory
(rlcore/run/ownership.py), through the real entry point under a real torchrun.

The test process is a child subreaper (``workers.launch.become_subreaper``), so it can reap ranks
orphaned by the ``kill -9`` of torchrun and read their exit codes. The kill -9 of a training run's
launcher group, with its exact resume and the phase machine's record of each checkpoint, is checked
on test_resume.py's launches (its B1 and B3) rather than on three launches of its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import QUIET_ENV, REPO
from workers.launch import become_subreaper, reap



def launch(out: str, steps: int, *extra: str) -> subprocess.Popen:
    """The demo under torchrun in a process group of its own (what a user's shell or a job gives it)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO, "train_grpo.py"), "--config", os.path.join(REPO, "configs", "demo_cpu.yaml"),
           "--trainer.output_dir", out, "--trainer.total_steps", str(steps), "--trainer.val_every", "0",
           "--trainer.val_before_train", "false", "--checkpoint.save_hf_final", "false",
           "--checkpoint.save_every", "2", "--checkpoint.keep_last", "10", *extra]
    env = {**os.environ, **QUIET_ENV, "PYTHONPATH": REPO}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def rows(out: str) -> list[dict]:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def wait_rows(out: str, n: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while len(rows(out)) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no {n} rows in {timeout} s"
        time.sleep(0.05)


def ranks_of(launcher_pid: int) -> list[int]:
    """The pids whose parent is the torchrun process."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == launcher_pid:
                out.append(int(entry))
    return out


@pytest.fixture(scope="module", autouse=True)
def subreaper():
    become_subreaper()
    yield
    become_subreaper(False)


def test_a_second_run_on_a_live_output_dir_exits_2_naming_the_holder(tiny_model, toy_data, tmp_path):
    data = ["--model.path", tiny_model, "--data.train_files", json.dumps([toy_data[0]]), "--data.val_files", "[]"]
    out = str(tmp_path / "shared")
    first = launch(out, 100000, *data)
    try:
        wait_rows(out, 1, first)
        holder = json.load(open(os.path.join(out, ".rlcore.lock")))
        second = launch(out, 3, *data)
        stdout, stderr = second.communicate(timeout=600)
        assert second.returncode != 0 and "exitcode  : 2" in stderr, stderr[-3000:]
        assert f"is in use by another run (host {holder['host']}, pid {holder['pid']}" in stderr, stderr[-3000:]
        assert "error: trainer.output_dir=" in stderr  # the one-line user error of every rank, no rank traceback
        assert first.poll() is None  # the first run goes on, its files untouched by the second
        before = rows(out)
        wait_rows(out, len(before) + 1, first)
        steps = [r["step"] for r in rows(out)]
        assert steps == list(range(1, len(steps) + 1)), steps
        assert sorted(os.listdir(os.path.join(out, "checkpoints")))[0].startswith(("latest", "step_"))
    finally:
        pids = ranks_of(first.pid)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        reap(pids, timeout=20)


def test_lock_is_exclusive_names_its_holder_and_dies_with_it(tmp_path):
    from rlcore.run import ownership

    out = str(tmp_path / "run")
    code = ("import sys, time; sys.path.insert(0, %r); from rlcore.run import ownership; "
            "assert ownership.lock_output_dir(%r) is None; print('locked', flush=True); time.sleep(60)") % (REPO, out)
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        problem = ownership.lock_output_dir(out)
        assert problem is not None and f"pid {holder.pid}" in problem and "trainer.output_dir" in problem, problem
        assert "another trainer.output_dir" in problem
    finally:
        holder.kill()
        holder.wait()
    assert ownership.lock_output_dir(out) is None  # the OS dropped the dead holder's lock: no stale lock
    assert ownership.lock_output_dir(out) is None  # held by this process already


@pytest.mark.serial
def test_a_rank_stops_when_its_parent_dies(tmp_path):
    """tie_to_launcher on a plain process: its parent is SIGKILLed, the process exits 77 (through
    the main thread's exit path: its atexit handler ran) well within the poll + grace time."""
    marker = tmp_path / "atexit"
    child_code = (
        "import atexit, os, sys, time; sys.path.insert(0, %r); from rlcore.run import ownership; "
        "atexit.register(lambda: open(%r, 'w').write('ran')); "
        "ownership.tie_to_launcher(0, force=True); print(os.getpid(), flush=True); time.sleep(60)"
    ) % (REPO, str(marker))
    # The parent starts the child and then waits forever; it is the one killed.
    parent_code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', %r]); "
                   "time.sleep(60)") % child_code
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    start = time.monotonic()
    codes = reap([child], timeout=15)
    assert codes == {child: 77}, codes
    assert time.monotonic() - start < 5
    assert marker.read_text() == "ran"
