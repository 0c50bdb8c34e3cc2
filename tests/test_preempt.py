"""Runs that end on purpose, with real signals on real 2-rank CPU runs (train_grpo.py under torchrun):

* SIGUSR1 delivered to ONE worker: both ranks agree at the next phase boundary, write one
  checkpoint and exit 75; the relaunch resumes from it; SIGTERM to torchrun (what Slurm and
  `kill` do) then stops the resumed run the same way. Time from signal to exit is printed.
* Non-finite losses (injected on one rank through the RLCORE_TEST_NAN_STEPS testing hook): the
  optimizer step is skipped and counted, and after trainer.max_consecutive_skips in a row the run
  stops with exit 3 and a checkpoint whose model and optimizer equal the last good update's.
* The grace deadline, the watchdog, and the Slurm batch script (dry run, and its signal/requeue
  logic with stand-ins for srun/scancel/scontrol).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import QUIET_ENV, REPO
from workers.launch import Launch, dcp_state, rank_exit_codes, read_rows, same, wait_gone

GRACE_S = 60


def args(model, data, out, steps, *extra):
    return ["--config", os.path.join(REPO, "configs", "demo_cpu.yaml"), "--model.path", model,
            "--data.train_files", json.dumps([data]), "--data.val_files", "[]", "--trainer.output_dir", out,
            "--trainer.total_steps", str(steps), "--trainer.prompts_per_step", "4", "--rollout.n", "4",
            "--checkpoint.resume", "auto", "--trainer.preempt_grace_s", str(GRACE_S), *extra]


def latest(out: str) -> int:
    with open(os.path.join(out, "checkpoints", "latest")) as f:
        return int(f.read().strip().removeprefix("step_"))


def test_signal_one_rank_stops_all_then_resume_and_sigterm_torchrun(tiny_model, toy_data, tmp_path):
    out = str(tmp_path / "run")
    # 1) SIGUSR1 to rank 1 only; a 2 s watchdog threshold makes the slow start-up report itself.
    first = Launch(2, args(tiny_model, toy_data[0], out, 500, "--trainer.watchdog_s", "2"),
                   launcher_args=("--monitor-interval=5",))
    try:
        first.wait_for(r"^step     2 ")
        workers = first.worker_pids()
        t_signal = time.monotonic()
        os.kill(workers[1], signal.SIGUSR1)
        usr1_s = wait_gone(workers.values(), timeout=GRACE_S + 60) - t_signal  # both ranks gone
        rc = first.wait(timeout=60)
    finally:
        first.close()
    text = first.output
    assert rc != 0 and rank_exit_codes(text) == {0: 75, 1: 75}, text[-4000:]
    assert "rank 1: received SIGUSR1" in text and "rank 0: received" not in text
    step = latest(out)
    for rank in (0, 1):
        assert f"rank {rank}: preempted at step {step} " in text, text[-4000:]
        assert f"watchdog: rank {rank} has been in phase 'build'" in text
    assert [r["step"] for r in read_rows(out)] == list(range(1, step + 1))  # nothing lost, nothing extra
    assert usr1_s < GRACE_S

    # 2) Resume, then SIGTERM to torchrun, which forwards it to both ranks.
    second = Launch(2, args(tiny_model, toy_data[0], out, 500))
    try:
        second.wait_for(rf"resumed from .*step_{step} at step {step}")
        second.wait_for(rf"^step {step + 2:>5} ")
        workers = second.worker_pids()
        t_signal = time.monotonic()
        second.proc.send_signal(signal.SIGTERM)
        term_s = wait_gone(workers.values(), timeout=GRACE_S + 60) - t_signal
        second.wait(timeout=60)
        torchrun_s = time.monotonic() - t_signal
    finally:
        second.close()
    text = second.output
    step2 = latest(out)
    assert step2 >= step + 2
    for rank in (0, 1):
        assert f"rank {rank}: received SIGTERM" in text, text[-4000:]
        assert f"rank {rank}: preempted at step {step2} " in text and "exiting with code 75" in text, text[-4000:]
    assert [r["step"] for r in read_rows(out)] == list(range(1, step2 + 1))
    assert term_s < GRACE_S
    print(f"\nsignal -> both ranks exited: SIGUSR1 to one worker {usr1_s:.2f} s (checkpoint step_{step}); "
          f"SIGTERM to torchrun {term_s:.2f} s (checkpoint step_{step2}; torchrun itself gone after "
          f"{torchrun_s:.2f} s); grace {GRACE_S} s")


def test_non_finite_steps_are_skipped_counted_and_stop_the_run(tiny_model, toy_data, tmp_path):
    out = str(tmp_path / "nan")
    run = Launch(2, args(tiny_model, toy_data[0], out, 8, "--checkpoint.save_every", "1", "--checkpoint.keep_last", "10",
                         "--trainer.max_consecutive_skips", "2"),
                 env={"RLCORE_TEST_NAN_STEPS": "2,4,5"}, launcher_args=("--monitor-interval=5",))
    try:
        rc = run.wait(timeout=900)
    finally:
        run.close()
    text = run.output
    assert rc != 0 and rank_exit_codes(text) == {0: 3, 1: 3}, text[-4000:]
    for step in (2, 4, 5):
        assert f"step {step}: non-finite loss or grad norm" in text
    assert "step 3: non-finite" not in text
    assert "error: training stopped at step 5: 2 steps in a row" in text
    assert text.count("Traceback (most recent call last)") == 1, text[-4000:]  # torchrun's own report only
    rows = {r["step"]: r for r in read_rows(out)}
    assert sorted(rows) == [1, 2, 3, 4, 5]
    assert [rows[s]["actor/skipped"] for s in range(1, 6)] == [0, 1, 0, 1, 1]
    assert [rows[s]["actor/skipped_steps"] for s in range(1, 6)] == [0, 1, 1, 2, 3]
    assert rows[2]["actor/grad_norm"] == "nan"
    assert latest(out) == 5
    s1, s2, s3, s5 = (dcp_state(os.path.join(out, "checkpoints", f"step_{s}"), tmp_path) for s in (1, 2, 3, 5))
    # Skipped steps change neither the model nor the optimizer (AdamW moments and step counts).
    assert same(s1, s2) and same(s3, s5)
    assert not same(s2["optimizer"]["state"], s3["optimizer"]["state"])  # step 3 did update
    state = torch.load(os.path.join(out, "checkpoints", "step_5", "extra_state", "extra_state_rank_0.pt"),
                       weights_only=True)["user"]["trainer"]
    assert state["skips"] == {"total": 3, "consecutive": 2}


def test_grace_deadline_ends_a_stuck_rank(tmp_path):
    """A rank that never reaches a phase boundary exits 76 once trainer.preempt_grace_s has passed."""
    code = ("import os, signal, time\nfrom rlcore.preempt import StopRequest\n"
            "s = StopRequest(grace_s=1.0, rank=0).install()\n"
            "t = time.monotonic(); os.kill(os.getpid(), signal.SIGTERM)\n"
            "while True: time.sleep(0.05)\n")
    env = {**os.environ, **QUIET_ENV, "PYTHONPATH": REPO}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 76, proc.stderr
    assert "rank 0: received SIGTERM" in proc.stderr and "no checkpoint within trainer.preempt_grace_s=1 s" in proc.stderr
    assert time.monotonic() - start < 60


def test_watchdog_names_phase_and_rank(capfd):
    from rlcore.preempt import Watchdog

    dog = Watchdog(rank=3, threshold_s=0.2, pg_timeout_s=99)
    with dog.phase("weight_sync"):
        time.sleep(0.7)
    with dog.phase("generate"):
        time.sleep(0.05)
    dog.close()
    err = capfd.readouterr().err
    assert "watchdog: rank 3 has been in phase 'weight_sync' for" in err
    assert err.count("phase 'weight_sync'") >= 2  # repeated every threshold while stuck
    assert "'generate'" not in err and "parallel.timeout_s=99" in err


# ---------------------------------------------------------------------------------------------
# Slurm batch script
# ---------------------------------------------------------------------------------------------

SBATCH = os.path.join(REPO, "scripts", "slurm", "train_grpo.sbatch")
SLURM_ENV = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "8",
             "SLURM_JOB_NODELIST": "gpu-a,gpu-b", "SLURM_JOB_NAME": "grpo", "SLURM_RESTART_COUNT": "1"}


def sbatch(tmp_path, *args, env=None, **kw):
    full = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full.update(SLURM_ENV, REPO=REPO, LOG_ROOT=str(tmp_path / "logs"), **(env or {}))
    return subprocess.Popen(["bash", SBATCH, *args], env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **kw)


def test_sbatch_dry_run_prints_the_multinode_launch(tmp_path):
    header = open(SBATCH).read()
    assert "#SBATCH --signal=B:USR1@" in header and "#SBATCH --requeue" in header
    assert subprocess.run(["bash", "-n", SBATCH]).returncode == 0
    proc = sbatch(tmp_path, "configs/demo_cpu.yaml", "--trainer.total_steps", "7", env={"DRY_RUN": "1"})
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    launch = next(line for line in out.splitlines() if line.startswith("+ srun "))
    for part in ("--nodes=2 --ntasks-per-node=1", f"--output={tmp_path}/logs/grpo-4242/attempt1/node%n.log",
                 "torchrun --nnodes 2 --nproc_per_node 8", "--rdzv_backend c10d", "--rdzv_endpoint gpu-a:29500",
                 "--rdzv_id 4242", "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
                 "--shutdown-timeout 180", "train_grpo.py --config configs/demo_cpu.yaml --checkpoint.resume auto",
                 "--trainer.preempt_grace_s 120 --trainer.total_steps 7"):
        assert part in launch, (part, launch)
    assert "+ scancel --signal=TERM 4242" in out and "+ scontrol requeue 4242" in out
    assert not os.path.exists(tmp_path / "logs")  # a dry run creates nothing
    bad = sbatch(tmp_path, "configs/missing.yaml", env={"DRY_RUN": "1"})
    out, _ = bad.communicate(timeout=60)
    assert bad.returncode == 2 and "configs/missing.yaml" in out


FAKE_SRUN = """#!/bin/bash
echo "srun $*" >> "$FAKE_DIR/calls"
echo $$ > "$FAKE_DIR/srun.pid"
sleep 60 &
SLEEP=$!
trap 'echo "srun got TERM" >> "$FAKE_DIR/calls"; kill $SLEEP; exit 75' TERM
wait $SLEEP
"""
FAKE_SCANCEL = """#!/bin/bash
echo "scancel $*" >> "$FAKE_DIR/calls"
kill -TERM "$(cat "$FAKE_DIR/srun.pid")"
"""
FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$FAKE_DIR/calls"
if [ "$1" = show ]; then echo gpu-a; echo gpu-b; fi
"""


def test_sbatch_time_limit_signal_checkpoints_and_requeues(tmp_path):
    """The batch shell's own logic, run for real with stand-ins for srun, scancel and scontrol:
    SIGUSR1 -> scancel --signal=TERM (srun's tasks get SIGTERM and exit 75) -> scontrol requeue."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls"
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_DIR": str(tmp_path), "SLURM_JOB_NODELIST": "gpu-[a-b]"}
    proc = sbatch(tmp_path, "configs/demo_cpu.yaml", env=env)
    deadline = time.monotonic() + 30
    while not (tmp_path / "srun.pid").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=60)
    log = calls.read_text()
    assert proc.returncode == 75, out
    assert "--rdzv_endpoint gpu-a:29500" in log  # head node from scontrol show hostnames
    assert "scancel --signal=TERM 4242" in log and "srun got TERM" in log
    assert "scontrol requeue 4242" in log and "requeueing job 4242" in out
    assert os.path.isdir(tmp_path / "logs" / "grpo-4242" / "attempt1")
