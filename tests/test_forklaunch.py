"""The forked launcher of the test harnesses (tests/workers/forklaunch.py) gives a rank what the
real torchrun gives it, and fails a launch as torchrun does: the same script under both, side by
side (the probe imports nothing heavy, so the cold launch costs about a second of CPU)."""

import json
import os
import time

import pytest

import conftest
from conftest import REPO, run_torchrun

PROBE = os.path.join(REPO, "tests", "workers", "launch_probe.py")


def _ranks(proc) -> list[dict]:
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return sorted(rows, key=lambda r: int(r["vars"]["RANK"]))


def test_a_forked_rank_sees_what_a_torchrun_rank_sees(monkeypatch):
    faulty = os.path.join(REPO, "tests", "workers", "faulty_train.py")
    assert conftest.forks(PROBE) and conftest.forks(conftest.TRAIN, "tests/test_vl_e2e.py")
    for cold in conftest.COLD_FILES:  # the launch is what they test
        assert not any(conftest.forks(s, f"tests/{cold}") for s in (PROBE, conftest.TRAIN, faulty))
    assert not conftest.forks(os.path.join(REPO, "scripts", "bench_step.py"))
    forked = _ranks(run_torchrun(PROBE, 2, "x=1"))
    monkeypatch.setenv("RLCORE_TEST_LAUNCHER", "torchrun")
    assert not conftest.forks(PROBE)
    cold = _ranks(run_torchrun(PROBE, 2, "x=1"))
    assert len(forked) == len(cold) == 2
    for f, c in zip(forked, cold):
        assert f == c, (f, c)  # variables (the run id's presence), argv, sys.path[0], __main__, the gloo world
    assert cold[0]["path0"] == os.path.join(REPO, "tests", "workers") and cold[0]["name"] == "__main__"
    assert cold[1]["argv"] == [PROBE, "x=1"] and cold[1]["world"] == 2


def _zygote_and_env():
    """This pytest process's zygote (started by a launch if none is yet) and a launch's environment."""
    if not conftest._zygote:
        run_torchrun(PROBE, 1)
    return conftest._zygote[0], {**os.environ, **conftest.QUIET_ENV, "PYTHONPATH": REPO}


def test_a_failing_rank_fails_the_launch_and_ends_the_others():
    zygote, env = _zygote_and_env()
    started = time.monotonic()
    proc = zygote.run(PROBE, 2, ["fail=1:3"], env, REPO, timeout=60)
    # rank 0 would sleep 120 s: the launcher SIGTERMed it when rank 1 exited 3
    assert proc.returncode == 1 and time.monotonic() - started < 30, (proc.returncode, proc.stderr)
    assert "rank 1 (pid" in proc.stderr and "exited 3" in proc.stderr, proc.stderr


def test_a_launch_past_its_timeout_is_killed():
    import subprocess

    zygote, env = _zygote_and_env()
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run(PROBE, 2, ["fail=5:0"], env, REPO, timeout=3)  # no rank 5: both sleep 120 s
