"""A killed launcher takes its ranks with it, and two runs never write one output directory
(rlcore/run/ownership.py), through the real entry point under a real torchrun.

The test process is a child subreaper (``workers.launch.become_subreaper``), so it can reap ranks
orphaned by the ``kill -9`` of torchrun and read their exit codes. The kill -9 of a training run's
launcher group, with its exact resume and the phase machine's record of each checkpoint, is checked
on test_resume.py's launches (its B1 and B3) rather than on three launches of its own, and a second
run on a live output directory (exit 2 naming the holder) on test_preempt.py's first launch.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from conftest import REPO
from workers.launch import become_subreaper, reap


@pytest.fixture(scope="module", autouse=True)
def subreaper():
    become_subreaper()
    yield
    become_subreaper(False)


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
