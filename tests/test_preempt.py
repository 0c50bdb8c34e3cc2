"""Runs that end on purpose, with real signals on real 2-rank CPU runs (train_grpo.py under torchrun):

* SIGUSR1 delivered to ONE worker: both ranks agree at the next phase boundary, write one
  checkpoint and exit 75 (before it, a second run on the same output directory exits 2 naming the
  first as the holder, and the first goes on); the relaunch resumes from it; SIGTERM to torchrun (what Slurm and
  `kill` do) then stops the resumed run the same way. Time from signal to exit is printed.
* Non-finite losses (injected on one rank through the RLCORE_TEST_NAN_STEPS testing hook): the
  optimizer step is skipped and counted, and after trainer.max_consecutive_skips in a row the run
  stops with exit 3 and a checkpoint whose model and optimizer equal the last good update's.
* The grace deadline, the watchdog, and the Slurm batch script (dry run, and its signal/requeue
  logic with stand-ins for srun/scancel/scontrol).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import QUIET_ENV, REPO
from workers.launch import FAULTY, Launch, dcp_state, rank_exit_codes, read_rows, same, wait_gone

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
    # tp=2: vLLM's CPU tensor-parallel communicator keeps /dev/shm files with fixed names, which a
    # preempted rank must remove on its way out, or the resume's engine fails (errno 17).
    tp = ("--rollout.tensor_parallel_size", "2", "--rollout.emulate_sleep", "true")  # + level 2 as on a GPU
    # 1) SIGUSR1 to rank 1 only; a 2 s watchdog threshold makes the slow start-up report itself.
    first = Launch(2, args(tiny_model, toy_data[0], out, 500, "--trainer.watchdog_s", "2", *tp),
                   launcher_args=("--monitor-interval=5",))
    try:
        first.wait_for(r"^step +2/")
        # A second run on the same output directory while the first trains: exit 2 before it loads
        # anything, naming the holder (rlcore/run/ownership.py); the first goes on untouched.
        holder = json.load(open(os.path.join(out, ".rlcore.lock")))
        second = Launch(2, args(tiny_model, toy_data[0], out, 3))
        try:
            assert second.wait(timeout=300) != 0
        finally:
            second.close()
        assert rank_exit_codes(second.output) == {0: 2, 1: 2}, second.output[-3000:]
        assert f"is in use by another run (host {holder['host']}, pid {holder['pid']}" in second.output
        assert "error: trainer.output_dir=" in second.output  # every rank's one-line error, no traceback
        assert "Traceback" not in second.output.split("error: trainer.output_dir=")[0][-2000:]
        assert first.proc.poll() is None
        workers, ports = first.worker_pids(), [first.master_port()]
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
    second = Launch(2, args(tiny_model, toy_data[0], out, 500, *tp))
    try:
        second.wait_for(rf"resumed from .*step_{step} at step {step}")
        second.wait_for(rf"^step +{step + 2}/")
        workers = second.worker_pids()
        ports.append(second.master_port())
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
    # this test's two launches only: another test's live tp > 1 engine may hold its own files now
    assert not [f for port in ports for f in glob.glob(f"/dev/shm/*-run{port}-cpushm*")], ports
    print(f"\nsignal -> both ranks exited: SIGUSR1 to one worker {usr1_s:.2f} s (checkpoint step_{step}); "
          f"SIGTERM to torchrun {term_s:.2f} s (checkpoint step_{step2}; torchrun itself gone after "
          f"{torchrun_s:.2f} s); grace {GRACE_S} s")


def test_non_finite_steps_are_skipped_counted_and_stop_the_run(tiny_model, toy_data, tmp_path):
    out = str(tmp_path / "nan")
    run = Launch(2, args(tiny_model, toy_data[0], out, 8, "--checkpoint.save_every", "1", "--checkpoint.keep_last", "10",
                         "--trainer.max_consecutive_skips", "2"),
                 env={"RLCORE_TEST_NAN_STEPS": "2,4,5"}, script=FAULTY, launcher_args=("--monitor-interval=5",))
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
    code = ("import os, signal, time\nfrom rlcore.run.preempt import StopRequest\n"
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
    from rlcore.run.preempt import Watchdog

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
case "$1 $2" in  # the shapes of Slurm 22.05's answers (seen under the real one, tests/test_multinode.py)
  "show hostnames") echo gpu-a; echo gpu-b ;;
  "show node") echo "NodeName=$3 Arch=x86_64 CoresPerSocket=1 NodeAddr=127.0.0.1 NodeHostName=$3 State=ALLOCATED" ;;
  "show job") echo "JobId=$3 JobName=grpo JobState=RUNNING Reason=None Requeue=1 Restarts=0" ;;
esac
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
    assert "--rdzv_endpoint 127.0.0.1:29500" in log  # the first of scontrol show hostnames, by its NodeAddr
    assert "scancel --signal=TERM 4242" in log and "srun got TERM" in log
    assert "scontrol requeue 4242" in log and "requeueing job 4242" in out
    assert os.path.isdir(tmp_path / "logs" / "grpo-4242" / "attempt1")


# ---------------------------------------------------------------------------------------------
# Slurm batch script: devices (CUDA / Ascend NPU), network interfaces, kill-on-bad-exit
# ---------------------------------------------------------------------------------------------

# `npu-smi info -m` on an Atlas A3 node: 8 modules of 2 compute chips (16 devices) plus one Mcu each.
FAKE_NPU_SMI = """#!/bin/bash
[ "$1 $2" = "info -m" ] || exit 1
printf '%-31s%-31s%-31s%s\\n' "NPU ID" "Chip ID" "Chip Logic ID" "Chip Name"
for npu in 0 1 2 3 4 5 6 7; do
  printf '%-31s%-31s%-31s%s\\n' $npu 0 $((2 * npu)) "Ascend 910_9391"
  printf '%-31s%-31s%-31s%s\\n' $npu 1 $((2 * npu + 1)) "Ascend 910_9391"
  printf '%-31s%-31s%-31s%s\\n' $npu 2 - Mcu
done
"""
FAKE_NVIDIA_SMI_NONE = """#!/bin/bash
echo "No devices were found"
exit 6
"""
FAKE_NVIDIA_SMI_FOUR = """#!/bin/bash
for i in 0 1 2 3; do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-$i)"; done
"""
# Records the environment and arguments the ranks would get, then ends like a finished run.
FAKE_SRUN_ENV = """#!/bin/bash
echo "srun $*" >> "$FAKE_DIR/calls"
env > "$FAKE_DIR/srun.env"
exit 0
"""


def isolated_bin(tmp_path, **fakes):
    """A PATH holding only the tools the batch script uses plus the given stand-ins, so whatever
    nvidia-smi / npu-smi the test machine has cannot change which device the script detects."""
    import shutil

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in ("bash", "dirname", "awk", "grep", "wc", "sed", "date", "cat", "env", "mkdir"):
        found = shutil.which(tool)
        assert found, tool
        os.symlink(found, bin_dir / tool)
    for name, text in fakes.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return str(bin_dir)


NO_DEVICE_ENV = {"SLURM_GPUS_ON_NODE": "", "CUDA_VISIBLE_DEVICES": "", "ASCEND_RT_VISIBLE_DEVICES": "", "DEVICE": "",
                 "NPROC_PER_NODE": "", "IFNAME": "", "GLOO_SOCKET_IFNAME": "", "NCCL_SOCKET_IFNAME": "",
                 "HCCL_SOCKET_IFNAME": "", "ASCEND_TOOLKIT_HOME": "", "ATB_HOME_PATH": ""}


def dry_run(tmp_path, env, *args):
    proc = sbatch(tmp_path, "configs/demo_cpu.yaml", *args, env={**NO_DEVICE_ENV, "DRY_RUN": "1", **env})
    out, _ = proc.communicate(timeout=60)
    launch = next((line for line in out.splitlines() if line.startswith("+ srun ")), "")
    envline = next((line for line in out.splitlines() if line.startswith("environment: ")), "")
    return proc.returncode, out, launch, envline.removeprefix("environment: ").split()


def test_sbatch_dry_run_kill_on_bad_exit_and_ifname(tmp_path):
    header = open(SBATCH).read()
    import re

    # NPU clusters have no gpu GRES, and a header line cannot be undone: GPU users pass it to sbatch.
    assert not re.search(r"^#SBATCH --(gpus-per-node|gres)", header, re.M)
    rc, out, launch, env = dry_run(tmp_path, {"SLURM_GPUS_ON_NODE": "8"})
    assert rc == 0, out
    assert launch.startswith("+ srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --output="), launch
    assert "2 node(s) x 8 cuda rank(s) (from SLURM_GPUS_ON_NODE)" in out
    assert env == [] and "note: IFNAME and GLOO_SOCKET_IFNAME are unset" in out  # 2 nodes: say how to fix gloo
    # IFNAME sets gloo's and NCCL's interface; a variable the user set keeps its value.
    rc, out, launch, env = dry_run(tmp_path, {"SLURM_GPUS_ON_NODE": "8", "IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "eth1"})
    assert rc == 0, out
    assert env == ["GLOO_SOCKET_IFNAME=ib0", "NCCL_SOCKET_IFNAME=eth1"], out
    assert "note: IFNAME" not in out and "MULTI_STREAM_MEMORY_REUSE" not in out  # no Ascend variables on CUDA
    # GLOO_SOCKET_IFNAME alone (no IFNAME) is shown and silences the note.
    rc, out, launch, env = dry_run(tmp_path, {"SLURM_GPUS_ON_NODE": "8", "GLOO_SOCKET_IFNAME": "bond0"})
    assert rc == 0 and env == ["GLOO_SOCKET_IFNAME=bond0"] and "note: IFNAME" not in out, out


def test_sbatch_dry_run_gpu_count_without_slurm_gres(tmp_path):
    """No SLURM_GPUS_ON_NODE (submitted without --gpus-per-node): nvidia-smi counts the GPUs, or the
    script stops with exit 2 and says how to request them."""
    path = isolated_bin(tmp_path, **{"nvidia-smi": FAKE_NVIDIA_SMI_FOUR})
    rc, out, launch, _ = dry_run(tmp_path, {"PATH": path})
    assert rc == 0, out
    assert "--nproc_per_node 4 " in launch and "x 4 cuda rank(s) (from nvidia-smi -L)" in out
    rc, out, launch, _ = dry_run(tmp_path, {"PATH": path, "CUDA_VISIBLE_DEVICES": "0,1"})
    assert rc == 0 and "--nproc_per_node 2 " in launch, out
    (tmp_path / "bin" / "nvidia-smi").write_text(FAKE_NVIDIA_SMI_NONE)
    rc, out, launch, _ = dry_run(tmp_path, {"PATH": path})
    assert rc == 2 and not launch, out
    assert "found no GPU" in out and "--gpus-per-node=N" in out and "NPROC_PER_NODE" in out
    rc, out, launch, _ = dry_run(tmp_path, {"PATH": path, "NPROC_PER_NODE": "3"})
    assert rc == 0 and "--nproc_per_node 3 " in launch, out


def test_sbatch_dry_run_npu_node(tmp_path):
    """An Ascend A3 node: detected by npu-smi, 16 ranks (one per chip), CANN's set_env.sh sourced,
    the Ascend variables set (each overridable), HCCL's interface from IFNAME."""
    path = isolated_bin(tmp_path, **{"npu-smi": FAKE_NPU_SMI})
    ascend = tmp_path / "Ascend"
    for sub in ("ascend-toolkit", "nnal/atb"):
        (ascend / sub).mkdir(parents=True)
        (ascend / sub / "set_env.sh").write_text("export ASCEND_FAKE=1\n")
    base = {"PATH": path, "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "npu-a", "ASCEND_HOME": str(ascend)}
    rc, out, launch, env = dry_run(tmp_path, {**base, "IFNAME": "enp189s0f0", "TASK_QUEUE_ENABLE": "2"})
    assert rc == 0, out
    assert launch.startswith("+ srun --nodes=1 --ntasks-per-node=1 --kill-on-bad-exit=1 "), launch
    assert "torchrun --nnodes 1 --nproc_per_node 16 " in launch and "--rdzv_endpoint npu-a:29500" in launch
    assert "1 node(s) x 16 npu rank(s) (from npu-smi info -m)" in out
    assert f"+ source {ascend}/ascend-toolkit/set_env.sh" in out and f"+ source {ascend}/nnal/atb/set_env.sh" in out
    assert env == ["HCCL_CONNECT_TIMEOUT=1200", "MULTI_STREAM_MEMORY_REUSE=2", "TASK_QUEUE_ENABLE=2",
                   "CPU_AFFINITY_CONF=1", "GLOO_SOCKET_IFNAME=enp189s0f0", "NCCL_SOCKET_IFNAME=enp189s0f0",
                   "HCCL_SOCKET_IFNAME=enp189s0f0"], out
    assert "note: IFNAME" not in out  # one node: nothing crosses nodes
    # ASCEND_RT_VISIBLE_DEVICES alone marks an NPU node and gives the count; a set-up CANN is not re-sourced.
    rc, out, launch, env = dry_run(tmp_path, {"PATH": isolated_bin(tmp_path / "x"), "ASCEND_HOME": str(ascend),
                                              "ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3", "ASCEND_TOOLKIT_HOME": "/opt/cann",
                                              "ATB_HOME_PATH": "/opt/atb"})
    assert rc == 0, out
    assert "torchrun --nnodes 2 --nproc_per_node 4 " in launch and "(from ASCEND_RT_VISIBLE_DEVICES)" in out
    assert "+ source" not in out and "MULTI_STREAM_MEMORY_REUSE=2" in env
    # DEVICE=npu without any NPU to count: exit 2 naming what to set.
    rc, out, launch, _ = dry_run(tmp_path, {"PATH": isolated_bin(tmp_path / "y"), "DEVICE": "npu",
                                            "ASCEND_HOME": str(ascend)})
    if not os.path.exists("/dev/davinci0"):
        assert rc == 2 and "found no NPU" in out and "ASCEND_RT_VISIBLE_DEVICES" in out, out
    rc, out, _, _ = dry_run(tmp_path, {"DEVICE": "tpu"})
    assert rc == 2 and "DEVICE=tpu" in out


def test_sbatch_npu_environment_reaches_the_ranks(tmp_path):
    """Not a dry run: CANN's set_env.sh is really sourced (under set -u, reading an unset variable),
    and srun, which passes its environment to every node's torchrun, sees the Ascend and interface
    variables and gets --kill-on-bad-exit=1."""
    path = isolated_bin(tmp_path, **{"npu-smi": FAKE_NPU_SMI, "srun": FAKE_SRUN_ENV})
    ascend = tmp_path / "Ascend"
    (ascend / "ascend-toolkit").mkdir(parents=True)
    (ascend / "ascend-toolkit" / "set_env.sh").write_text(
        'export ASCEND_TOOLKIT_HOME=/fake/cann/latest\n'
        'export LD_LIBRARY_PATH=/fake/cann/lib64:$UNSET_BY_ANYONE_RLCORE\nfalse\n')
    env = {**NO_DEVICE_ENV, "PATH": path, "FAKE_DIR": str(tmp_path), "ASCEND_HOME": str(ascend), "IFNAME": "ib0",
           "HEAD_NODE": "npu-a"}
    proc = sbatch(tmp_path, "configs/demo_cpu.yaml", env=env)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "training finished (exit 0)" in out, out
    calls = (tmp_path / "calls").read_text()
    assert calls.startswith("srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 ") and "--nproc_per_node 16" in calls
    seen = dict(line.split("=", 1) for line in (tmp_path / "srun.env").read_text().splitlines() if "=" in line)
    for key, value in (("ASCEND_TOOLKIT_HOME", "/fake/cann/latest"), ("HCCL_CONNECT_TIMEOUT", "1200"),
                       ("MULTI_STREAM_MEMORY_REUSE", "2"), ("TASK_QUEUE_ENABLE", "1"), ("CPU_AFFINITY_CONF", "1"),
                       ("GLOO_SOCKET_IFNAME", "ib0"), ("NCCL_SOCKET_IFNAME", "ib0"), ("HCCL_SOCKET_IFNAME", "ib0")):
        assert seen.get(key) == value, (key, seen.get(key), out)
