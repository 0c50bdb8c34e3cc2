"""A train_grpo.py launch under a real torchrun that a test can watch and signal while it runs:
output streamed line by line (with arrival times), the workers' pids by rank, kill -9 and signals.
Used by test_resume.py and test_preempt.py (importable as ``workers.launch``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(REPO, "train_grpo.py")
FAULTY = os.path.join(REPO, "tests", "workers", "faulty_train.py")  # train_grpo.py with injected faults
DROP = ("timing/", "memory/", "perf/")  # wall-clock dependent metrics


class Launch:
    def __init__(self, nproc: int, args: list[str], env: dict | None = None, script: str = TRAIN,
                 launcher_args: tuple[str, ...] = (), rendezvous: tuple[str, ...] = ("--standalone",)):
        """``rendezvous``: torchrun's rendezvous arguments (one agent of a multi-node run: --nnodes,
        --rdzv_backend, --rdzv_endpoint, --rdzv_id)."""
        from conftest import QUIET_ENV

        cmd = [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--nproc_per_node={nproc}",
               *launcher_args, script, *args]
        full_env = {**os.environ, **QUIET_ENV, "PYTHONPATH": REPO, **(env or {})}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(line for _, line in self.lines)

    def wait_for(self, pattern: str, timeout: float = 300) -> float:
        """Block until a line matches ``pattern`` (regex); returns its arrival time."""
        regex, seen, deadline = re.compile(pattern), 0, time.monotonic() + timeout
        with self._cond:
            while True:
                for t, line in self.lines[seen:]:
                    if regex.search(line):
                        return t
                seen = len(self.lines)
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise AssertionError(f"launch exited ({self.proc.returncode}) before /{pattern}/:\n"
                                         + self.output[-6000:])
                if time.monotonic() > deadline:
                    raise AssertionError(f"no line /{pattern}/ within {timeout} s:\n" + self.output[-6000:])
                self._cond.wait(timeout=1.0)

    def worker_pids(self) -> dict[int, int]:
        """{rank: pid} of torchrun's worker processes (children of the launcher)."""
        pids = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                if ppid != self.proc.pid:
                    continue
                pids[int(_environ(int(entry))[b"RANK"])] = int(entry)
            except (OSError, KeyError, ValueError, IndexError):
                continue
        return pids

    def master_port(self) -> str:
        """torchrun's MASTER_PORT for this launch's ranks (read from a live rank's environment): it
        scopes the launch's CPU tensor-parallel /dev/shm files (rollout.cpu_kv.scope_cpu_shm_names)."""
        for pid in self.worker_pids().values():
            try:
                return _environ(pid)[b"MASTER_PORT"].decode()
            except (OSError, KeyError):
                continue
        raise AssertionError("no live rank to read MASTER_PORT from")

    def kill9(self) -> None:
        """kill -9 the launcher and every worker at once (a node dying)."""
        workers = self.worker_pids()
        for pid in [self.proc.pid, *workers.values()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)
        for pid in workers.values():  # reap check: none may survive to write anything
            for _ in range(100):
                if not os.path.exists(f"/proc/{pid}") or _is_zombie(pid):
                    break
                time.sleep(0.1)

    def wait(self, timeout: float = 600) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return rc

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill9()


def kill9_when(nproc: int, args: list[str], *patterns: str, timeout: float = 600) -> None:
    """Launch, wait for each output line pattern in turn, then kill -9 the launcher and its ranks."""
    killed = Launch(nproc, args)
    try:
        for pattern in patterns:
            killed.wait_for(pattern, timeout=timeout)
        killed.kill9()
    finally:
        killed.close()


def preempt_at(nproc: int, args: list[str], step: int, timeout: float = 600) -> str:
    """Launch tests/workers/faulty_train.py, whose last rank sends itself SIGUSR1 in ``step``'s
    generation phase (a preemption mid-step); wait for the ranks to exit. Returns the output."""
    preempted = Launch(nproc, args, env={"RLCORE_TEST_SIGNAL_STEP": str(step)}, script=FAULTY,
                       launcher_args=("--monitor-interval=5",))
    try:
        preempted.wait(timeout=timeout)
    finally:
        preempted.close()
    return preempted.output


def _environ(pid: int) -> dict[bytes, bytes]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def read_rows(out_dir: str) -> list[dict]:
    import json

    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(DROP)}


def rank_exit_codes(output: str) -> dict[int, int]:
    """Per-rank exit codes from torchrun's failure report (it lists every failed rank)."""
    codes = {}
    for rank, code in re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", output):
        codes[int(rank)] = int(code)
    return codes


def dcp_state(ckpt: str, tmp_dir) -> dict:
    """Model and optimizer of a DCP checkpoint as full tensors (one process, no process group)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = os.path.join(str(tmp_dir), ckpt.strip("/").replace("/", "_") + ".pt")
    dcp_to_torch_save(ckpt, target)
    return torch.load(target, weights_only=True)


def same(a, b) -> bool:
    """Bit-for-bit equality of nested tensors / containers (dtype included)."""
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def wait_gone(pids, timeout: float = 120) -> float:
    """Block until every pid has exited (or is a zombie); returns that moment."""
    deadline = time.monotonic() + timeout
    while any(os.path.exists(f"/proc/{pid}") and not _is_zombie(pid) for pid in pids):
        if time.monotonic() > deadline:
            raise AssertionError(f"processes {list(pids)} still alive after {timeout} s")
        time.sleep(0.02)
    return time.monotonic()


PR_SET_CHILD_SUBREAPER = 36


def become_subreaper(on: bool = True) -> None:
    """Make this process a child subreaper (``PR_SET_CHILD_SUBREAPER``): ranks orphaned by a
    ``kill -9`` of torchrun are re-parented to it instead of to PID 1, so ``reap`` can tell by pid
    when each one has ended and read its exit code."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0


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


def checkpoint_events(output: str, rank: int) -> list[str]:
    """The phase machine's record of one rank's checkpoint saves and loads (logging.switch_trace)."""
    return [line.split("checkpoint ", 1)[1] for line in output.splitlines()
            if line.startswith(f"[switch] rank {rank} checkpoint ")]
