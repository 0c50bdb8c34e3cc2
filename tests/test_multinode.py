"""More than one node, on one machine: two torchrun agents that meet at a c10d rendezvous, and the
Slurm batch script under a real slurmctld/slurmd (tests/workers/slurm_cluster.py).

One reference run (one agent, 2 ranks, STEPS steps, a checkpoint every 2) is the metrics every other
run here must reproduce row for row:
  * two agents of 1 rank each, agent 1 (not hosting the rendezvous store) killed with kill -9: the
    other agent's rank ends on its own (its next collective fails: the peer's socket is gone);
    resumed, then agent 0 (the store's host) killed: the other agent loses the store and stops its
    rank; resumed again to the end. Checkpoints hold both nodes' shards and are committed once.
  * sbatch on two Slurm nodes, stopped as by the time limit (scancel --signal=USR1 --batch, what
    --signal=B:USR1@N delivers): checkpoint, exit 75, requeue, resume, the same rows.
Plus: a tensor-parallel group that would span two agents exits 2 before loading; a rank killed on
one Slurm node ends the whole job (srun --kill-on-bad-exit) while the other node's rank is frozen,
so only Slurm can end it; a second submission on the same output directory exits 2 naming the holder.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time

import pytest

from conftest import QUIET_ENV, REPO
from workers.launch import Launch, comparable, rank_exit_codes, read_rows, wait_gone
from workers.slurm_cluster import SlurmCluster, free_ports, missing

STEPS = 20
SBATCH = os.path.join(REPO, "scripts", "slurm", "train_grpo.sbatch")


def args(model, data, out, *extra):
    return ["--config", os.path.join(REPO, "configs", "demo_cpu.yaml"), "--model.path", model,
            "--data.train_files", json.dumps([data]), "--data.val_files", "[]", "--trainer.output_dir", out,
            "--trainer.total_steps", str(STEPS), "--trainer.prompts_per_step", "4", "--rollout.n", "4",
            "--checkpoint.save_every", "2", "--checkpoint.keep_last", "20", "--checkpoint.resume", "auto", *extra]


def latest(out: str) -> int:
    with open(os.path.join(out, "checkpoints", "latest")) as f:
        return int(f.read().strip().removeprefix("step_"))


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def two_agents(argv: list[str], run_id: str) -> list[Launch]:
    """Two torchrun agents of one rank each. Agent 0 starts first and binds the rendezvous port, so
    it hosts the c10d store (torchrun hosts it on whichever agent binds the endpoint first)."""
    (port,) = free_ports(1)
    rdzv = ("--nnodes", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", run_id)
    first = Launch(1, argv, rendezvous=rdzv)
    deadline = time.monotonic() + 60
    while not listening(port):
        assert first.proc.poll() is None and time.monotonic() < deadline, first.output[-3000:]
        time.sleep(0.1)
    return [first, Launch(1, argv, rendezvous=rdzv)]


def wait_either(launches: list[Launch], pattern: str, timeout: float = 300) -> None:
    regex, deadline = re.compile(pattern, re.M), time.monotonic() + timeout
    while not any(regex.search(x.output) for x in launches):
        assert time.monotonic() < deadline, f"no /{pattern}/ within {timeout} s:\n" + launches[0].output[-3000:]
        assert any(x.proc.poll() is None for x in launches), "\n".join(x.output[-3000:] for x in launches)
        time.sleep(0.2)


def kill_agent(launches: list[Launch], victim: int, timeout: float = 90) -> tuple[float, str]:
    """kill -9 one agent and its rank (a node dying); returns how long the other agent's rank took
    to end, and the other agent's output."""
    other = launches[1 - victim]
    survivors = other.worker_pids().values()
    launches[victim].kill9()
    t0 = time.monotonic()
    gone = wait_gone(survivors, timeout=timeout) - t0
    assert other.wait(timeout=timeout) != 0
    return gone, other.output


@pytest.fixture(scope="module")
def reference(tiny_model, toy_data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("one_agent") / "run")
    run = Launch(2, args(tiny_model, toy_data[0], out))
    try:
        assert run.wait(timeout=600) == 0, run.output[-4000:]
    finally:
        run.close()
    rows = read_rows(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return [comparable(r) for r in rows]


def test_two_agents_reproduce_one_and_resume_exactly_after_either_agent_dies(reference, tiny_model, toy_data,
                                                                              tmp_path):
    out = str(tmp_path / "run")
    argv = args(tiny_model, toy_data[0], out)

    # 1) agent 1 dies: rank 0's next collective fails (gloo: connection reset), rank 0 exits 1
    launches = two_agents(argv, "mn1")
    try:
        wait_either(launches, r"^step +3/")
        gone_s, text = kill_agent(launches, victim=1)
    finally:
        for x in launches:
            x.close()
    assert gone_s < 30 and re.search(r"gloo.*Connection (reset|closed) by peer", text), text[-4000:]
    saved = re.findall(r"saved checkpoint .*/(step_\d+)$", text, re.M)
    assert saved and len(saved) == len(set(saved)), saved  # each committed once, by rank 0
    first_stop = latest(out)
    shards = os.listdir(os.path.join(out, "checkpoints", f"step_{first_stop}"))
    assert {"rng_rank0.pt", "rng_rank1.pt"} <= set(shards)  # written by both nodes' ranks
    assert any(f.startswith("__0_") for f in shards) and any(f.startswith("__1_") for f in shards), shards

    # 2) resumed on two agents; agent 0 (the store's host) dies: agent 1 loses the rendezvous
    #    store, sends its rank SIGTERM, and the rank's checkpoint attempt fails on the dead peer
    launches = two_agents(argv, "mn2")
    try:
        wait_either(launches, rf"resumed from .*step_{first_stop} at step {first_stop}")
        wait_either(launches, rf"^step +{first_stop + 3}/")
        gone_s, text = kill_agent(launches, victim=0)
    finally:
        for x in launches:
            x.close()
    assert gone_s < 30 and "The connection to the C10d store has failed" in text, text[-4000:]
    second_stop = latest(out)
    assert second_stop > first_stop

    # 3) resumed to the end: every row equals the one-agent run's, none lost or repeated
    launches = two_agents(argv, "mn3")
    try:
        rcs = [x.wait(timeout=600) for x in launches]
    finally:
        for x in launches:
            x.close()
    assert rcs == [0, 0], "\n".join(x.output[-3000:] for x in launches)
    assert any(re.search(rf"resumed from .*step_{second_stop} at step {second_stop}", x.output) for x in launches)
    assert [comparable(r) for r in read_rows(out)] == reference


def test_a_tensor_parallel_group_across_two_agents_exits_2_before_loading(tiny_model, toy_data, tmp_path):
    out = str(tmp_path / "run")
    launches = two_agents(args(tiny_model, toy_data[0], out, "--rollout.tensor_parallel_size", "2"), "mntp")
    try:
        rcs = [x.wait(timeout=300) for x in launches]
    finally:
        for x in launches:
            x.close()
    text = "\n".join(x.output for x in launches)
    assert rcs == [1, 1] and sorted(rank_exit_codes(text).values()) == [2, 2], text[-4000:]
    assert ("rollout.tensor_parallel_size=2 puts ranks 0-1 of one vLLM tensor-parallel group on nodes [0, 1] "
            "(torchrun agents of [1] rank(s) each)") in text
    assert not os.path.exists(out)  # refused before anything was written


@pytest.mark.unit
def test_tensor_parallel_groups_must_stay_inside_nodes():
    from rlcore.config import ConfigError
    from rlcore.run.preflight import check_tp_inside_nodes

    check_tp_inside_nodes(2, [0, 0, 1, 1])
    check_tp_inside_nodes(1, [0, 1])
    check_tp_inside_nodes(4, [0, 0, 0, 0, 1, 1, 1, 1])
    for tp, nodes in ((2, [0, 1]), (2, [0, 0, 0, 1, 1, 1]), (4, [0, 0, 1, 1, 2, 2, 3, 3])):
        with pytest.raises(ConfigError, match=f"rollout.tensor_parallel_size={tp} puts ranks"):
            check_tp_inside_nodes(tp, nodes)


@pytest.mark.unit
def test_the_dry_run_refuses_tensor_parallelism_across_nodes():
    from rlcore.run.dry_run import check_world
    from rlcore.config.cli import parse_config

    cfg = parse_config(["--config", os.path.join(REPO, "configs", "demo_cpu.yaml"), "--rollout.tensor_parallel_size",
                        "2", "--trainer.prompts_per_step", "8", "--rollout.n", "4",
                        "--model.path", os.path.join(REPO, "configs")])
    fail = check_world(cfg, nproc=1, nnodes=2)
    assert fail.status == "FAIL" and "divides the ranks per node" in fail.detail, fail
    assert "tensor_parallel_size" not in check_world(cfg, nproc=2, nnodes=2).detail


# ----------------------------------------------------------------------------- a real Slurm


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = missing()
    if why:
        if os.environ.get("RLCORE_REQUIRE_SLURM") == "1":
            pytest.fail(f"RLCORE_REQUIRE_SLURM=1 but no Slurm can start: {why}")
        pytest.skip(f"no Slurm here: {why}")
    cluster = SlurmCluster(str(tmp_path_factory.mktemp("slurm"))).start()
    yield cluster
    cluster.stop()


def submit(slurm: SlurmCluster, tmp_path, argv: list[str], nodes: str, nproc: int = 1) -> tuple[int, str]:
    """sbatch the repository's script as a user would, with the CPU partition's settings; returns the
    job id and its log root."""
    logs = str(tmp_path / "logs")
    (port,) = free_ports(1)
    env = {**QUIET_ENV, "PYTHONPATH": REPO, "DEVICE": "cpu", "NPROC_PER_NODE": str(nproc),
           "MASTER_PORT": str(port), "LOG_ROOT": logs, "PREEMPT_GRACE_S": "60"}
    count = len(slurm.run("scontrol", "show", "hostnames", nodes).split())
    job = slurm.sbatch(f"--nodes={count}", f"--nodelist={nodes}", f"--output={tmp_path}/job-%j.out", SBATCH,
                       "configs/demo_cpu.yaml", *argv, env=env, cwd=REPO)
    return job, logs


def node_logs(logs: str, job: int, attempt: int) -> str:
    folder = os.path.join(logs, f"grpo-{job}", f"attempt{attempt}")
    if not os.path.isdir(folder):
        return ""
    text = []
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), errors="replace") as f:
            text.append(f.read())
    return "\n".join(text)


def wait_logged(logs: str, job: int, attempt: int, pattern: str, slurm: SlurmCluster, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not re.search(pattern, node_logs(logs, job, attempt), re.M):
        state = slurm.job(job).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job} {state}:\n{node_logs(logs, job, attempt)[-4000:]}"
        assert time.monotonic() < deadline, f"no /{pattern}/ within {timeout} s:\n{node_logs(logs, job, attempt)[-4000:]}"
        time.sleep(0.3)


def job_processes(job: int, node: str | None = None, ranks_only: bool = False) -> list[int]:
    """Pids whose environment says they belong to Slurm job ``job`` (on ``node``; torchrun's workers
    and their children only)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"SLURM_JOB_ID") != str(job).encode():
            continue
        if node and env.get(b"SLURMD_NODENAME") != node.encode():
            continue
        if ranks_only and b"LOCAL_RANK" not in env:
            continue
        pids.append(int(entry))
    return pids


def test_sbatch_time_limit_stop_checkpoints_requeues_and_resumes_exactly(slurm, reference, tiny_model, toy_data,
                                                                          tmp_path):
    out = str(tmp_path / "run")
    job, logs = submit(slurm, tmp_path, args(tiny_model, toy_data[0], out), "n[1-2]")
    wait_logged(logs, job, 0, r"^step +2/", slurm)
    slurm.run("scancel", "--signal=USR1", "--batch", str(job))  # what --signal=B:USR1@N sends
    requeued = slurm.wait_state(job, ("PENDING",), timeout=120)
    assert requeued["Restarts"] == "1", requeued
    # Skip Slurm's 2-minute requeue delay, but only once the nodes are clean: slurmd refuses a job's
    # credential issued within the second of its revocation ("Job credential revoked").
    slurm.until_idle(("n1", "n2"))
    time.sleep(2)
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    done = slurm.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), timeout=300)
    with open(tmp_path / f"job-{job}.out") as f:
        log = f.read()
    assert done["JobState"] == "COMPLETED" and done["Restarts"] == "1", (done, log)
    for attempt in (0, 1):  # where docs/cluster.md says: LOG_ROOT/<job-name>-<job-id>/attempt<N>/node<K>.log
        assert sorted(os.listdir(os.path.join(logs, f"grpo-{job}", f"attempt{attempt}"))) == ["node0.log", "node1.log"]
    first = node_logs(logs, job, 0)
    assert "batch shell got SIGUSR1" in log and f"requeueing job {job}" in log, log
    assert f"job {job} attempt 1:" in log and "training finished (exit 0)" in log, log
    # torchrun itself gets the SIGTERM too and ends on it, so no per-rank exit table: each rank says
    stop = int(re.search(r"preempted at step (\d+)", first).group(1))
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: preempted at step {stop} .*checkpoint step_{stop} is complete; exiting "
                         "with code 75", first), first[-4000:]
    assert re.search(rf"resumed from .*step_{stop} at step {stop}", node_logs(logs, job, 1))
    assert [comparable(r) for r in read_rows(out)] == reference


def test_sbatch_a_crashed_rank_ends_the_whole_job_and_a_second_run_on_its_folder_exits_2(slurm, tiny_model,
                                                                                         toy_data, tmp_path):
    out = str(tmp_path / "run")
    argv = args(tiny_model, toy_data[0], out, "--trainer.total_steps", "100000")
    job, logs = submit(slurm, tmp_path, argv, "n[1-2]")
    wait_logged(logs, job, 0, r"^step +2/", slurm)

    # a second run on the same output directory, on the third node, while the first trains
    dup_dir = tmp_path / "dup"
    dup_dir.mkdir()
    dup, dup_logs = submit(slurm, dup_dir, argv, "n3")
    dup_state = slurm.wait_state(dup, ("COMPLETED", "FAILED", "CANCELLED"), timeout=300)
    dup_text = node_logs(dup_logs, dup, 0)
    assert dup_state["JobState"] == "FAILED" and rank_exit_codes(dup_text) == {0: 2}, (dup_state, dup_text[-3000:])
    assert re.search(rf"trainer.output_dir='{re.escape(out)}' is in use by another run \(host \S+, pid \d+", dup_text)
    assert slurm.job(job)["JobState"] == "RUNNING"  # the first run did not notice

    # freeze node 1's rank (it cannot end on its own), kill -9 node 2's: only Slurm can end the job
    frozen = job_processes(job, "n1", ranks_only=True)  # the rank and any child it started
    victims = job_processes(job, "n2", ranks_only=True)
    assert frozen and victims, (frozen, victims)
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    ended = slurm.wait_state(job, ("FAILED", "CANCELLED", "COMPLETED"), timeout=120)
    ended_s = time.monotonic() - t0
    with open(tmp_path / f"job-{job}.out") as f:
        log = f.read()
    assert ended["JobState"] == "FAILED" and "training failed" in log, (ended, log)
    assert ended_s < 60, ended_s
    deadline = time.monotonic() + 30
    while job_processes(job):  # slurmstepd's last processes go shortly after the state changes
        assert time.monotonic() < deadline, f"left running: {job_processes(job)}"
        time.sleep(0.5)


def test_sbatch_a_plain_scancel_cancels_and_does_not_requeue(slurm, tiny_model, toy_data, tmp_path):
    out = str(tmp_path / "run")
    job, logs = submit(slurm, tmp_path, args(tiny_model, toy_data[0], out), "n3")
    wait_logged(logs, job, 0, r"^train data:", slurm)  # the ranks are starting
    slurm.run("scancel", str(job))
    slurm.wait_state(job, ("CANCELLED", "FAILED", "COMPLETED", "PENDING"), timeout=60)
    time.sleep(3)  # a requeue would show as PENDING by now
    info = slurm.job(job)
    with open(tmp_path / f"job-{job}.out") as f:
        log = f.read()
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", (info, log)
    assert f"job {job} is being cancelled: it will not be requeued" in log and "requeueing" not in log, log
