"""A killed launcher takes its ranks with it, and two runs never write one output directory
(rlcore/run/ownership.py), through the real entry point under a real torchrun.

The test process makes itself a child subreaper (``PR_SET_CHILD_SUBREAPER``): ranks orphaned by the
``kill -9`` of torchrun are re-parented to it instead of to PID 1, so it can tell by pid when each
one has ended and read its exit code.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import QUIET_ENV, REPO

PR_SET_CHILD_SUBREAPER = 36
WALL_CLOCK = ("timing/", "perf/", "memory/")  # differ between any two runs


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


def reap(pids: list[int], timeout: float) -> dict[int, int]:
    """Wait (as their subreaper) until every pid has ended; their exit codes."""
    codes, deadline = {}, time.monotonic() + timeout
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    return codes


def comparable(rs: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in rs]


@pytest.fixture(scope="module", autouse=True)
def subreaper():
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    yield
    libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


ASLEEP = "phase training, vLLM released ['kv_cache']"


def checkpoint_events(stderr: str, rank: int) -> list[str]:
    """The phase machine's record of one rank's checkpoint saves and loads (logging.switch_trace)."""
    return [line.split("checkpoint ", 1)[1] for line in stderr.splitlines()
            if line.startswith(f"[switch] rank {rank} checkpoint ")]


def test_kill9_of_the_launcher_group_ends_every_rank_then_resume_is_exact(tiny_model, toy_data, tmp_path):
    """Also the phase machine's record (logging.switch_trace) of every save and of the resume's load:
    each in the train phase with vLLM's memory released (on CPU its KV cache: no sleep mode), so the
    trainer state a save brings to the device never meets vLLM's (docs/memory_plan.md, checkpoint
    column). The loop used to save after the weight sync, with vLLM awake. (Checked on these
    launches rather than two of its own: the suite's time is kept under 20 minutes.)"""
    data = ["--model.path", tiny_model, "--data.train_files", json.dumps([toy_data[0]]), "--data.val_files", "[]"]
    trace = ("--logging.switch_trace", "true")
    reference = launch(str(tmp_path / "reference"), 6, *data, *trace)
    _, ref_err = reference.communicate(timeout=600)
    assert reference.returncode == 0, ref_err[-3000:]
    for rank in (0, 1):
        assert checkpoint_events(ref_err, rank) == [f"save step_{s}: {ASLEEP}" for s in (2, 4, 6)], ref_err[-3000:]

    out = str(tmp_path / "killed")
    run = launch(out, 6, *data)
    wait_rows(out, 2, run)
    latest = os.path.join(out, "checkpoints", "latest")
    while not os.path.exists(latest):  # step 2's checkpoint, written after its row
        assert run.poll() is None, run.communicate()
        time.sleep(0.02)
    pids = ranks_of(run.pid)
    assert len(pids) == 2, pids
    os.killpg(run.pid, signal.SIGKILL)  # torchrun and its group; the ranks are in sessions of their own
    killed_at = time.monotonic()
    run.wait()
    at_kill = len(rows(out))
    codes = reap(pids, timeout=20)
    gone_s = time.monotonic() - killed_at
    print(f"ranks ended {gone_s:.2f} s after the kill, codes {codes}, rows at kill {at_kill}")
    assert sorted(codes) == sorted(pids), f"ranks still alive 20 s after the launcher died: {set(pids) - set(codes)}"
    assert set(codes.values()) <= {77, -9}, codes  # Exit.ORPHANED (or killed at the watcher's own deadline)
    assert gone_s < 15
    time.sleep(1.0)
    assert len(rows(out)) == at_kill < 6  # nothing written after the kill

    # A new run takes the lock at once (the OS dropped it with the dead holder) and resumes exactly.
    resumed = launch(out, 6, *data, *trace, "--checkpoint.resume", "auto")
    stdout, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr[-3000:]
    assert "resumed from" in stdout, stdout[-2000:]
    assert comparable(rows(out)) == comparable(rows(str(tmp_path / "reference")))
    start = int(re.search(r"resumed from \S+ at step (\d+)", stdout).group(1))
    for rank in (0, 1):
        assert checkpoint_events(stderr, rank) == [f"load step_{start}: {ASLEEP}"] + [
            f"save step_{s}: {ASLEEP}" for s in range(start + 2, 7, 2)], stderr[-3000:]


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
