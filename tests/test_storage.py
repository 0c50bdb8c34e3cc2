"""When the run's storage fails (rlcore/run/storage.py): storage made to fail for real, as root
does it (CI runs as root): small tmpfs mounts that fill up, directories made read-only with a
read-only bind mount, a data file removed mid-run. Where mounting is impossible (not root, no
mount permission in a container) those tests skip with the reason; the module prints how many.

The trainer chain (2 CPU ranks, 3 steps, a checkpoint every step; R is the uninterrupted run):
  A   on a 32 MiB tmpfs; another job fills it between step 2's space check and its checkpoint
      (tests/workers/faulty_train.py): ENOSPC inside DCP's save on every rank; the training file is
      removed after step 1 (read whole at start-up: no effect). Real torchrun: its report's codes.
  B   resumes A's step_1 in another folder (as the message says), which turns read-only before
      step 3's metrics row: rank 0's write fails, every rank stops at the next agreement.
  C   resumes B's step_2 on an 8 MiB tmpfs that fills before step 3's space check, with
      checkpoint.on_low_space=skip: the checkpoint is skipped, the run ends 0.
  D   the issue's case: a 6 MiB tmpfs holds step_1, and the check before step 2's checkpoint stops
      every rank (checkpoint.on_low_space=stop, the default) before anything of it is written.
Rows of A (1), B (2) and C (3) equal R's, every value but wall-clock ones.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import REPO, WORKERS, run_torchrun
from workers.launch import FAULTY, TRAIN, Launch, comparable, rank_exit_codes, read_rows

SKIPPED: list[str] = []  # tests skipped for want of mounts, printed at the module's end


def mount_problem() -> str | None:
    """Why this process cannot mount a tmpfs (None: it can), tried for real once."""
    if os.geteuid() != 0:
        return "not root: a tmpfs or read-only bind mount needs root (CI runs as root)"
    probe = "/tmp/rlcore-mount-probe"
    os.makedirs(probe, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"mount failed: {done.stderr.strip()}"
    subprocess.run(["umount", probe], check=True)
    return None


MOUNT_PROBLEM = mount_problem()


@pytest.fixture(scope="module", autouse=True)
def count_skips():
    yield
    print(f"\ntests/test_storage.py: {len(SKIPPED)} test(s) skipped for want of mounts"
          + (f" ({SKIPPED[0]})" if SKIPPED else ""), file=sys.__stderr__, flush=True)


@pytest.fixture(autouse=True)
def clean_state():
    """A run ends at its first failure; these tests go on in one process: no failure carries over."""
    from rlcore import errors
    from rlcore.run import storage

    yield
    errors.pending().clear()
    storage._failed[0] = False


class Mounts:
    """tmpfs and read-only bind mounts, every one unmounted by the owning fixture's finalizer."""

    def __init__(self, root):
        self.root, self.made = root, []

    def tmpfs(self, name: str, size: str) -> str:
        path = os.path.join(str(self.root), name)
        os.makedirs(path)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], check=True)
        self.made.append(path)
        return path

    def readonly(self, path: str) -> str:
        self.made.append(path)
        for cmd in (["mount", "--bind", path, path], ["mount", "-o", "remount,bind,ro", path]):
            subprocess.run(cmd, check=True)
        return path

    def track(self, path: str) -> None:
        """A folder a launched run may mount over (faulty_train's read-only hook)."""
        self.made.append(path)

    def close(self) -> None:
        for path in reversed(self.made):
            for _ in range(4):  # stacked mounts (a bind over a tmpfs) come off one by one
                if subprocess.run(["umount", "-l", path], capture_output=True).returncode != 0:
                    break
        self.made = []


def need_mounts():
    if MOUNT_PROBLEM:
        SKIPPED.append(MOUNT_PROBLEM)
        pytest.skip(MOUNT_PROBLEM)


@pytest.fixture
def mounts(tmp_path):
    need_mounts()
    m = Mounts(tmp_path)
    yield m
    m.close()


# ---------------------------------------------------------------------------------------------
# In one process: the errors, the rows, `latest`, the checks, the message
# ---------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_a_failed_write_is_found_behind_wrappers_and_recorded_when_deferred():
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    from rlcore import errors

    full = OSError(errno.ENOSPC, "No space left on device", "/out/x.distcp")
    assert errors.storage_oserror(full) == (full, None)
    try:
        try:
            raise full
        except OSError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert errors.storage_oserror(outer) == (full, None)
    dcp = CheckpointException("write", {1: (full, None)})  # DCP's report of rank 1's failure, on every rank
    assert errors.storage_oserror(dcp) == (full, 1)
    assert errors.storage_oserror(OSError(errno.EINVAL, "Invalid argument")) is None  # a bug, not the disk
    with pytest.raises(errors.StorageError, match=r"writing latest failed: /out/x.distcp: \[Errno 28\] No space "
                                                  r"left on device \(ENOSPC\)"):
        with errors.writing("latest", "/out"):
            raise dcp
    with pytest.raises(ValueError):  # anything else passes through untouched
        with errors.writing("latest", "/out"):
            raise ValueError("not storage")
    after = []
    with errors.deferred():
        with errors.writing("a row", "/out/metrics.jsonl"):
            raise PermissionError(errno.EROFS, "Read-only file system")
        after.append("went on")
    assert after == ["went on"] and [(e.what, e.errno, e.path) for e in errors.pending()] == [
        ("a row", errno.EROFS, "/out/metrics.jsonl")]


@pytest.mark.unit
def test_metrics_rows_are_whole_or_absent_on_a_full_disk(mounts):
    from rlcore.errors import StorageError
    from rlcore.metrics import MetricsLogger

    out = mounts.tmpfs("out", "64k")
    logger = MetricsLogger(out, True, tensorboard=False, console_every=10**6)
    step, big = 0, {f"k{i:04d}": float(i) for i in range(300)}  # ~5 KiB a row
    with pytest.raises(StorageError, match=r"metrics.jsonl \(the row of step \d+\) failed: .*ENOSPC"):
        while step < 100:
            step += 1
            logger.log(step, big)
    text = open(os.path.join(out, "metrics.jsonl")).read()
    rows = [json.loads(line) for line in text.splitlines()]
    assert text.endswith("\n") and [r["step"] for r in rows] == list(range(1, step)), "a partial row was left"
    print(f"\n64 KiB tmpfs: {step - 1} whole rows, the row of step {step} ({len(json.dumps(big))} bytes) failed whole")


@pytest.mark.unit
def test_an_output_folder_that_vanished_is_not_made_again(tmp_path):
    """A clean-up job removed the run's folder (or its filesystem was unmounted, leaving the empty
    mount point): the next row, sample file or checkpoint folder fails with ENOENT, naming it."""
    from rlcore.errors import StorageError
    from rlcore.metrics import MetricsLogger
    from rlcore.run import checkpoint, storage
    from rlcore.step.validation import write_examples

    out = tmp_path / "run"
    logger = MetricsLogger(str(out), True, tensorboard=False)
    shutil.rmtree(out)
    with pytest.raises(StorageError, match=r"metrics.jsonl \(the row of step 1\) failed: .*ENOENT"):
        logger.log(1, {"reward/mean": 0.5})
    with pytest.raises(StorageError, match=r"validation samples of step 1 failed: .*run: \[Errno 2\] the run's "
                                           r"output folder is gone \(ENOENT\)"):
        write_examples(str(out), 1, [])
    with pytest.raises(storage.StorageFailed) as failed:  # a section: every rank (here one) agrees
        checkpoint.write(None, str(out), 1, {}, rank=0)
    assert [(f["what"], f["errno"]) for f in failed.value.failures] == [("checkpoint step_1 (its folder)", 2)]
    assert not out.exists()


@pytest.mark.unit
def test_a_partial_last_row_is_cut_when_the_next_run_starts(tmp_path, capsys):
    from rlcore.metrics import MetricsLogger, cut_partial_row

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "reward/me')  # a write cut short (not by us)
    MetricsLogger(str(tmp_path), True, tensorboard=False).log(3, {"reward/mean": 0.5})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    assert "metrics.jsonl: removed a partial last row (22 bytes)" in capsys.readouterr().out
    assert cut_partial_row(str(path)) == 0 and cut_partial_row(str(tmp_path / "none.jsonl")) == 0


@pytest.mark.unit
def test_latest_is_replaced_atomically_or_not_at_all(mounts):
    from rlcore.run import checkpoint

    root = mounts.tmpfs("ckpts", "64k")
    checkpoint._write_latest(root, "step_1")
    fill(root, 0)
    with pytest.raises(OSError):
        checkpoint._write_latest(root, "step_2")
    assert open(os.path.join(root, "latest")).read() == "step_1\n" and ".latest.tmp" not in os.listdir(root)


@pytest.mark.unit
def test_the_lora_adapter_folder_takes_its_tensors_before_it_fails(mounts):
    """hf_folder.write_adapter: the tensors (collective gathers in a run) are all taken before the
    first write, and a failed write is a StorageError naming the folder (the rollout's, per rank)."""
    import torch

    from rlcore import hf_folder
    from rlcore.errors import StorageError

    taken = []

    def tensors():
        for i in range(3):
            taken.append(i)
            yield f"w{i}", torch.zeros(4)

    readonly = mounts.readonly(mounts.tmpfs("adapter", "1m"))
    with pytest.raises(StorageError, match=r"writing a LoRA adapter folder failed: .*adapter/a.*EROFS"):
        hf_folder.write_adapter(tensors(), {"r": 1}, os.path.join(readonly, "a"))
    assert taken == [0, 1, 2]


def fill(folder: str, left: int) -> None:
    """Take all but ``left`` bytes of ``folder``'s filesystem (another job's file)."""
    st = os.statvfs(folder)
    fd = os.open(os.path.join(folder, "filler.bin"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize - left)
    os.close(fd)


@pytest.mark.unit
def test_the_message_says_what_failed_what_is_intact_and_how_to_resume(tmp_path):
    from rlcore.run import storage

    out = str(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "x"')
    failures = [{"rank": r, "host": "node0", "what": "checkpoint step_3 (model and optimizer shards, extra state)",
                 "path": f"{out}/checkpoints/.tmp-step_3/__{r}_0.distcp", "errno": 28, "strerror": "No space left"}
                for r in (0, 1)]
    argv = ["--config", "c.yaml", "--trainer.output_dir", out, "--checkpoint.resume=auto", "--rollout.n", "4"]
    commands = storage.resume_commands(argv, out, f"{out}/checkpoints/step_2", 2, 1)
    text = storage.message(storage.StorageFailed(failures), 3, out, f"{out}/checkpoints/step_2",
                           ["removed the partial .tmp-step_3"], commands)
    lines = text.splitlines()
    assert lines[0] == "error: the run's storage failed at step 3:"
    assert lines[1] == (f"  writing checkpoint step_3 (model and optimizer shards, extra state) failed: {out}/checkpoints/"
                        ".tmp-step_3/__0_0.distcp: [Errno 28] No space left on device (ENOSPC); rank 0 on node0")
    assert lines[3] == f"  intact: checkpoint {out}/checkpoints/step_2; metrics.jsonl whole up to step 2"
    assert lines[4] == "  removed the partial .tmp-step_3"
    assert lines[6] == (f"    torchrun --nproc_per_node=2 train_grpo.py --config c.yaml --rollout.n 4 "
                        f"--trainer.output_dir {out} --checkpoint.resume auto")
    assert lines[7].endswith(f"--rollout.n 4 --trainer.output_dir NEW_DIR --checkpoint.resume {out}/checkpoints/step_2")
    assert lines[-1] == "  every rank exits with code 74 (RLCORE_DEBUG=1 prints the tracebacks)"
    low = storage.message(storage.StorageFailed([], {"need": 3 << 20, "free": 1 << 20, "mount": "/mnt",
                                                     "what": "checkpoint step_3"}), 3, out, None, [], commands[:1])
    assert low.splitlines()[0] == ("error: not enough space for checkpoint step_3 at step 3: it needs about 3.0 MiB "
                                   "(the last checkpoint's size), 1.0 MiB is free on /mnt; nothing of it was written")
    assert "intact: no complete checkpoint; metrics.jsonl whole up to step 2" in low


@pytest.mark.unit
def test_rank_0_prints_the_message_and_so_does_a_failing_rank_of_another_node(monkeypatch):
    from rlcore.run import storage

    failures = [{"rank": r, "host": "node1", "what": "x", "path": "/local/x", "errno": 28, "strerror": "full"}
                for r in (9, 10)]
    monkeypatch.setattr(storage.socket, "gethostname", lambda: "node1")
    monkeypatch.setenv("GROUP_RANK", "1")  # ranks 8-15 on the second node
    assert [r for r in range(8, 16) if storage.prints_message(failures, r)] == [9]
    monkeypatch.setenv("GROUP_RANK", "0")
    assert storage.prints_message(failures, 0) and not storage.prints_message(failures, 1)


def run_of(cfg, out: str) -> SimpleNamespace:
    """What lifecycle.room reads of a Run (rank 0 of a one-process world; no engines)."""
    return SimpleNamespace(cfg=cfg, info=SimpleNamespace(is_main=True, rank=0, world_size=1), resume_from=None,
                           state=SimpleNamespace(skipped_saves=[]))


@pytest.mark.unit
def test_before_a_checkpoint_the_space_is_checked_against_the_last_ones_size(mounts, tiny_model, capsys):
    from rlcore.config.cli import parse_config
    from rlcore.run import checkpoint, lifecycle, storage

    out = mounts.tmpfs("out", "4m")
    cfg = parse_config(["--config", os.path.join(REPO, "configs", "demo_cpu.yaml"), "--model.path", tiny_model,
                        "--trainer.output_dir", out])
    step1 = os.path.join(checkpoint.checkpoint_root(out), "step_1")
    os.makedirs(step1)
    with open(os.path.join(step1, "model.bin"), "wb") as f:
        f.write(b"\0" * (1 << 20))  # a 1 MiB "checkpoint" with its manifest
    checkpoint._write_manifest(step1)
    checkpoint._write_latest(checkpoint.checkpoint_root(out), "step_1")
    run = run_of(cfg, out)
    assert lifecycle.room(run, 2, True, False)  # 1 MiB fits in ~3 MiB
    fill(out, 512 << 10)
    with pytest.raises(storage.StorageFailed) as stopped:
        lifecycle.room(run, 2, True, False)  # checkpoint.on_low_space=stop (the default)
    note = stopped.value.low_space
    assert note["what"] == "checkpoint step_2" and note["need"] == checkpoint.size(step1) and note["free"] <= 512 << 10
    cfg.checkpoint.on_low_space = "skip"
    assert not lifecycle.room(run, 2, True, False) and run.state.skipped_saves == [2]
    assert "warning: skipping checkpoint step_2: it needs about 1.0 MiB" in capsys.readouterr().err


@pytest.mark.unit
def test_start_up_refuses_an_output_dir_without_room_or_write_access(mounts, tiny_model, toy_data, capsys):
    """Before any model loads (preflight, what train_grpo.main runs first), on every rank: exit 2."""
    from test_bad_inputs import checks_exit_code

    from rlcore.config.cli import parse_config
    from rlcore.run import storage

    base = ["--config", os.path.join(REPO, "configs", "demo_cpu.yaml"), "--model.path", tiny_model,
            "--data.train_files", json.dumps([toy_data[0]]), "--data.val_files", "[]", "--trainer.prompts_per_step", "4",
            "--checkpoint.save_every", "1"]
    small = mounts.tmpfs("small", "1m")
    assert checks_exit_code(base + ["--trainer.output_dir", os.path.join(small, "run")], 2) == 2
    err = capsys.readouterr().err
    ckpt, hf, _ = storage.estimate_bytes(parse_config(base), 2)
    assert f"error: trainer.output_dir='{small}/run' has 1.0 MiB free (filesystem {small}), too little for this " \
           f"run: a checkpoint needs about {storage.mb(ckpt)} (302,336 parameters x 4 bytes (fp32) + 302,336 " \
           f"trainable x 8 bytes of adamw state + 2 ranks' file headers) and an HF export {storage.mb(hf)}" in err, err
    readonly = mounts.readonly(mounts.tmpfs("ro", "16m"))
    assert checks_exit_code(base + ["--trainer.output_dir", readonly], 2) == 2
    err = capsys.readouterr().err
    assert f"error: trainer.output_dir='{readonly}' cannot hold the run's files: writing {readonly}/.rlcore.lock " \
           f"failed: [Errno 30] Read-only file system (EROFS)" in err, err
    roomy = mounts.tmpfs("roomy", "8m")  # one checkpoint and the export fit, not keep_last=2 + 1
    assert checks_exit_code(base + ["--trainer.output_dir", roomy], 2) == 0
    assert "room for this run's next checkpoint" in capsys.readouterr().out


@pytest.mark.unit
def test_a_stop_signal_after_a_storage_failure_writes_nothing(capfd):
    import signal

    from rlcore.run import preempt, storage

    stop = preempt.StopRequest(grace_s=60, rank=1, signals=(signal.SIGUSR2,)).install()
    storage.mark_failed()
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        stop.cancel_deadline()
    finally:
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    err = capfd.readouterr().err
    assert "rank 1: received SIGUSR2 after a failed write of the run: no checkpoint is attempted; exiting with " \
           "code 74" in err and "then checkpointing" not in err, err


# ---------------------------------------------------------------------------------------------
# Two ranks agree on a failed write (gloo, no model)
# ---------------------------------------------------------------------------------------------


def test_every_rank_stops_together_whoever_failed_and_wherever(mounts, tmp_path):
    small_dcp, small_hf = mounts.tmpfs("dcp", "1m"), mounts.tmpfs("hf", "1m")
    os.makedirs(tmp_path / "ro")
    readonly = mounts.readonly(str(tmp_path / "ro"))
    proc = run_torchrun(os.path.join(WORKERS, "storage_agree.py"), 2, readonly, small_dcp, small_hf, timeout=300)
    results = {(r["case"], r["rank"]): r for r in
               (json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("result "))}
    assert len(results) == 8, proc.stdout + proc.stderr
    for case, (rank, errno_name) in {"rank0_only": (0, 30), "dcp": (1, 28), "stream": (0, 28)}.items():
        for r in (0, 1):
            got = results[(case, r)]
            assert got["failed"] and got["seconds"] < 30, (case, got)
            failures = {(f["rank"], f["errno"]) for f in got["failures"]}
            # DCP: rank 1's files fill the disk, and rank 0's writes of that moment may meet it too
            assert failures == {(rank, errno_name)} or case == "dcp" and failures == {(0, 28), (1, 28)}, (case, got)
    # rank 0 went on through every gather after its write failed, as rank 1 did
    assert results[("stream", 0)]["gathered"] == results[("stream", 1)]["gathered"] == list(range(8))
    assert not results[("clean", 0)]["failed"] and not results[("clean", 1)]["failed"]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]  # not even DCP's writer threads
    print("\n" + "; ".join(f"{c}: {results[(c, 0)]['seconds']:.2f} s" for c in ("rank0_only", "dcp", "stream")))


def test_a_ranks_failed_lora_adapter_push_stops_every_rank_together(mounts, tiny_model, toy_data, tmp_path):
    """LoRA pushes the adapter through a folder of each rank's own (/dev/shm, local to its host):
    when the last rank's write fails (a read-only mount here; a container's small /dev/shm in life),
    that rank keeps in step, and every rank stops at the step's agreement point with the one message:
    exit 74 on both, step 1's checkpoint intact and named by latest, nothing of step 2 committed."""
    ro = str(tmp_path / "adapter_ro")
    os.makedirs(ro)
    mounts.readonly(ro)
    out = str(tmp_path / "run")
    launch = failing(args(tiny_model, toy_data[0], out, "--lora.rank", "8", "--lora.alpha", "16",
                          "--rollout.emulate_sleep", "true"),
                     {"RLCORE_TEST_ADAPTER_ROOT_AT_STEP": f"2:{ro}"})
    text = launch.output
    assert rank_exit_codes(text) == {0: 74, 1: 74}, text[-5000:]
    assert text.count("error: the run's storage failed at step 2:") == 1, text[-5000:]
    assert "writing a LoRA adapter folder" in text and "(EROFS); rank 1 on" in text, text[-5000:]
    assert f"  intact: checkpoint {out}/checkpoints/step_1" in text, text[-5000:]
    assert f"  to resume, once {ro} can be written again" in text, text[-5000:]  # not the output folder
    assert text.count("Traceback (most recent call last)") == 1, text[-5000:]  # torchrun's own report only
    assert latest(out) == "step_1" and [r["step"] for r in read_rows(out) if "timing/step_s" in r] == [1, 2]


# ---------------------------------------------------------------------------------------------
# The trainer: a full disk, a read-only folder, a data file removed, a checkpoint that does not fit
# ---------------------------------------------------------------------------------------------

STEPS = 3


def args(model: str, data: str, out: str, *extra: str) -> list[str]:
    return ["--config", os.path.join(REPO, "configs", "demo_cpu.yaml"), "--model.path", model,
            "--data.train_files", json.dumps([data]), "--data.val_files", "[]", "--trainer.output_dir", out,
            "--trainer.total_steps", str(STEPS), "--trainer.prompts_per_step", "4", "--rollout.n", "4",
            "--checkpoint.save_every", "1", "--checkpoint.save_hf_final", "false", *extra]


def failing(argv: list[str], env: dict, after: tuple[str, callable] | None = None) -> Launch:
    """A run under the real torchrun (its report lists each rank's exit code) with a storage fault
    injected by tests/workers/faulty_train.py; ``after``: (output line, what the test does then)."""
    launch = Launch(2, argv, env=env, script=FAULTY, launcher_args=("--monitor-interval=5",))
    try:
        if after:
            launch.wait_for(after[0], timeout=600)
            after[1]()
        launch.wait(timeout=900)
    finally:
        launch.close()
    return launch


def latest(out: str) -> str:
    with open(os.path.join(out, "checkpoints", "latest")) as f:
        return f.read().strip()


@pytest.fixture(scope="module")
def chain(tiny_model, toy_data, tmp_path_factory):
    need_mounts()
    root = tmp_path_factory.mktemp("storage")
    m = Mounts(root)
    try:
        data = str(root / "train8.jsonl")
        with open(toy_data[0]) as src, open(data, "w") as dst:
            dst.writelines(src.readlines()[:8])
        r = str(root / "r")
        straight = run_torchrun(TRAIN, 2, *args(tiny_model, data, r))
        a = m.tmpfs("a", "32m")
        removed = str(root / "gone.jsonl")
        shutil.copy(data, removed)
        full = failing(args(tiny_model, removed, a), {"RLCORE_TEST_FILL": "after_check:2:262144"},
                       after=(r"^step +1/", lambda: os.remove(removed)))
        b = str(root / "b")
        os.makedirs(b)
        m.track(b)
        readonly = failing(args(tiny_model, data, b, "--checkpoint.resume", os.path.join(a, "checkpoints", "step_1")),
                           {"RLCORE_TEST_READONLY_AT_STEP": "3"})
        c = m.tmpfs("c", "8m")
        skipped = run_torchrun(FAULTY, 2, *args(tiny_model, data, c, "--checkpoint.resume",
                                                os.path.join(b, "checkpoints", "step_2"),
                                                "--checkpoint.on_low_space", "skip"),
                               env={"RLCORE_TEST_FILL": "before_check:3:1048576"})
        d = m.tmpfs("d", "6m")  # the case: room for the first checkpoint, not for the second
        small = failing(args(tiny_model, data, d), {})
        for name, text in (("straight", straight.stdout + straight.stderr), ("full", full.output),
                           ("readonly", readonly.output), ("skipped", skipped.stdout + skipped.stderr),
                           ("small", small.output)):
            (root / f"{name}.log").write_text(text)  # for a reader of a failure
        yield SimpleNamespace(r=r, a=a, b=b, c=c, d=d, data=data, removed=removed, straight=straight, full=full,
                              readonly=readonly, skipped=skipped, small=small, model=tiny_model)
    finally:
        m.close()


def test_a_full_disk_mid_checkpoint_ends_every_rank_with_one_message(chain):
    out = chain.full.output
    assert rank_exit_codes(out) == {0: 74, 1: 74}, out[-5000:]
    assert out.count("error: the run's storage failed at step 2:") == 1, out[-5000:]
    assert f"writing checkpoint step_2 (model and optimizer shards, extra state" in out, out[-5000:]
    assert "No space left on device (ENOSPC); ranks 0, 1 on" in out or "(ENOSPC); rank 1 on" in out, out[-5000:]
    a = chain.a
    assert f"  intact: checkpoint {a}/checkpoints/step_1; metrics.jsonl whole up to step 1" in out, out[-5000:]
    assert "  removed the partial .tmp-step_2" in out and not os.path.exists(f"{a}/checkpoints/.tmp-step_2")
    assert f"--trainer.output_dir NEW_DIR --checkpoint.resume {a}/checkpoints/step_1" in out
    assert out.count("Traceback (most recent call last)") == 1, out[-5000:]  # torchrun's own report only
    assert latest(a) == "step_1" and sorted(os.listdir(f"{a}/checkpoints")) == ["latest", "step_1"]
    # the training file went after step 1: it had been read whole at start-up, and step 2 ran on
    assert not os.path.exists(chain.removed)
    assert [comparable(r) for r in read_rows(a)] == [comparable(r) for r in read_rows(chain.r)[:1]]


def test_resumed_elsewhere_then_read_only_the_rows_are_the_uninterrupted_ones(chain):
    out = chain.readonly.output
    assert rank_exit_codes(out) == {0: 74, 1: 74}, out[-5000:]
    assert out.count("error: the run's storage failed at step 3:") == 1, out[-5000:]
    b = chain.b
    assert f"writing metrics.jsonl (the row of step 3) failed: {b}/metrics.jsonl: [Errno 30] Read-only file " \
           f"system (EROFS); rank 0 on" in out, out[-5000:]
    assert f"intact: checkpoint {b}/checkpoints/step_2; metrics.jsonl whole up to step 2" in out
    assert "(renamed into place" not in out  # without its row, step 3's checkpoint is not even tried
    assert "left the partial .tmp-step_3 ([Errno 30] Read-only file system (EROFS))" in out, out[-5000:]
    assert out.count("Traceback (most recent call last)") == 1, out[-5000:]
    assert latest(b) == "step_2"
    reference = [comparable(r) for r in read_rows(chain.r)]
    assert [comparable(r) for r in read_rows(b)] == reference[1:2]
    # C: B's step_2 resumed elsewhere; its checkpoint did not fit and was skipped (on_low_space=skip)
    c_out = chain.skipped.stdout + chain.skipped.stderr
    assert "warning: skipping checkpoint step_3: it needs about" in c_out, c_out[-5000:]
    assert f"checkpoints skipped for lack of space at steps [3] (newest: none in trainer.output_dir; this run " \
           f"resumed from {b}/checkpoints/step_2)" in c_out, c_out[-5000:]
    assert [comparable(r) for r in read_rows(chain.c)] == reference[2:3]


def test_a_disk_too_small_for_the_second_checkpoint_stops_before_writing_it(chain):
    """The issue's case (a filesystem that fills during the second checkpoint): the check before
    step 2's checkpoint finds too little room for another of step_1's size and stops every rank."""
    out, d = chain.small.output, chain.d
    assert rank_exit_codes(out) == {0: 74, 1: 74}, out[-5000:]
    assert "warning: trainer.output_dir=" in out and "room for this run's next checkpoint" in out  # at start-up
    assert out.count("error: not enough space for checkpoint step_2 at step 2: it needs about 3.8 MiB (the last "
                     "checkpoint's size),") == 1, out[-5000:]
    assert f"is free on {d}; nothing of it was written" in out
    assert f"intact: checkpoint {d}/checkpoints/step_1; metrics.jsonl whole up to step 1" in out
    assert out.count("Traceback (most recent call last)") == 1, out[-5000:]
    assert latest(d) == "step_1" and sorted(os.listdir(f"{d}/checkpoints")) == ["latest", "step_1"]
    assert [comparable(r) for r in read_rows(d)] == [comparable(r) for r in read_rows(chain.r)[:1]]


def test_the_start_up_estimate_is_the_checkpoint_written(chain):
    """The estimate behind the start-up check (the plan's fp32 weights and AdamW state, the ranks'
    file headers) against the checkpoint R wrote: not under it, within 10 % over."""
    from rlcore.config.cli import parse_config
    from rlcore.run import checkpoint, storage

    estimate = storage.estimate_bytes(parse_config(args(chain.model, chain.data, chain.r)), 2)[0]
    written = checkpoint.size(os.path.join(chain.r, "checkpoints", "step_3"))
    print(f"\ncheckpoint estimate {estimate} bytes, written {written} bytes ({written / estimate:.4f})")
    assert 0.9 <= written / estimate <= 1.0


def test_a_restart_without_its_data_file_names_it_and_what_is_intact(chain, capsys):
    from test_bad_inputs import checks_exit_code

    from rlcore.run.ownership import release_output_dirs

    try:
        code = checks_exit_code(args(chain.model, chain.removed, chain.a, "--checkpoint.resume", "auto"), 2)
    finally:
        release_output_dirs()
    err = capsys.readouterr().err
    assert code == 2 and f"data.train_files='{chain.removed}' is invalid: the file does not exist (nothing was " \
        f"written: checkpoint {chain.a}/checkpoints/step_1 is intact, and the run resumes from it once this is " \
        f"fixed)" in err, err
