"""The ``python`` tool's sandbox: model-written code runs in a child process that cannot hurt the run.

What holds the child (each layer where the OS allows it; :func:`isolation` says which are in effect):

- its own session (process group), killed whole on the wall-clock timeout or when its output
  passes the byte limit: a hang, a flood or a fork bomb ends with the call;
- rlimits: CPU seconds, address space (a memory bomb gets MemoryError), file size, open files,
  and processes (no fork, where the kernel enforces it for this user);
- an empty temporary working directory, removed afterwards; stdin closed; no inherited file
  descriptors; an environment of PATH and LANG only (no secrets the trainer holds);
- a fresh network namespace (no interface but a down loopback) where unshare(2) is allowed, and
  an unprivileged user id when the trainer runs as root;
- inside the interpreter (``python -I -S``), an audit hook that refuses sockets, subprocesses,
  fork/exec, ctypes and file writes outside the working directory.

This is not a security boundary against hostile code (a kernel exploit, or a model that learned
to escape audit hooks, defeats it): run the trainer in a container, or point ``tools`` at your own
sandbox service (docs/tools.md). It keeps honest-but-wrong code (the usual RL failure: loops,
huge prints, big allocations) from costing more than its own sample.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000

# Runs in the child (``python -I -S``): limits and namespaces first, then the audit hook, then the
# model's code with its own globals. It is done here rather than in a preexec_fn, which is unsafe in
# the trainer's multi-threaded process. Python's audit events
# (docs.python.org/3/library/audit_events.html): open (path, mode, flags), socket.*,
# subprocess.Popen, os.fork/forkpty/posix_spawn/exec/system, ctypes.dlopen, os.remove/rename/...
_RUNNER = r'''
import os, resource, sys
_cwd = os.getcwd()
_mb, _cpu, _fsize, _procs, _netns, _drop = __LIMITS__
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (_mb * 2**20, _mb * 2**20))
resource.setrlimit(resource.RLIMIT_FSIZE, (_fsize, _fsize))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if _netns:
    import ctypes
    # CLONE_NEWNET: only a down loopback from here on; without CAP_SYS_ADMIN, inside a new user
    # namespace (CLONE_NEWUSER), where unprivileged user namespaces are enabled
    if ctypes.CDLL(None).unshare(0x40000000) != 0:
        ctypes.CDLL(None).unshare(0x10000000 | 0x40000000)
    del ctypes
if _drop:  # root ignores RLIMIT_NPROC and owns every file: become nobody
    os.chown(_cwd, 65534, 65534)
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
resource.setrlimit(resource.RLIMIT_NPROC, (_procs, _procs))
_DENY = ("socket.", "subprocess.", "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn",
         "os.system", "os.kill", "os.killpg", "ctypes.", "pty.", "os.setuid", "os.chown", "os.chmod")
_PATHS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.symlink", "os.link", "os.truncate")
def _inside(path):
    path = os.path.realpath(os.fspath(path))
    return path == _cwd or path.startswith(_cwd + os.sep)
def _hook(event, args):
    if event.startswith(_DENY):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event in _PATHS and args and isinstance(args[0], (str, bytes, os.PathLike)) and not _inside(args[0]):
        raise PermissionError(f"sandbox: {event} outside the working directory is not allowed")
    if event == "open" and args[0] is not None and not isinstance(args[0], int):
        mode, flags = args[1] or "r", args[2] or 0
        writes = any(c in mode for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        if writes and not _inside(args[0]):
            raise PermissionError(f"sandbox: writing {os.fspath(args[0])} is not allowed (only the working directory)")
sys.addaudithook(_hook)
del _hook
exec(compile(__CODE__, "<tool>", "exec"), {"__name__": "__main__"})
'''


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    output_bytes: int = 16_384
    max_procs: int = 0  # further processes the child may start (RLIMIT_NPROC, for non-root uids)


@dataclass
class Result:
    output: str  # stdout then stderr, cut to the byte limit
    error: str | None  # None: ran and exited 0; else "timeout" | "output_limit" | "exit N" | "signal N"

    @property
    def ok(self) -> bool:
        return self.error is None


def _probe(code: str) -> bool:
    """Whether ``code`` runs in a fresh interpreter (exit 0): how the layers are probed once."""
    try:
        return subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


_ISOLATION: dict[str, bool] | None = None


def isolation() -> dict[str, bool]:
    """Which layers are in effect on this host (printed at start-up), probed once per process:
    unshare(CLONE_NEWNET) needs CAP_SYS_ADMIN or an unprivileged user namespace, and containers
    often allow neither;
    a root trainer drops the child to nobody only if nobody can still import the standard library
    (an interpreter under a 0700 home directory cannot be read by nobody)."""
    global _ISOLATION
    if _ISOLATION is None:
        netns = _probe("import ctypes, sys; u = ctypes.CDLL(None).unshare; "
                       f"sys.exit(u({_CLONE_NEWNET}) != 0 and u({_CLONE_NEWUSER | _CLONE_NEWNET}) != 0)")
        nobody = os.geteuid() == 0 and _probe(
            "import os; os.setgroups([]); os.setgid(65534); os.setuid(65534); import json, decimal, fractions")
        _ISOLATION = {"network_namespace": netns, "unprivileged_uid": nobody, "rlimits": True,
                      "own_session": True, "audit_hook": True}
    return _ISOLATION


def describe(limits: Limits) -> str:
    on = [k for k, v in isolation().items() if v]
    off = [k for k, v in isolation().items() if not v]
    return (f"python tool sandbox: {', '.join(on)}" + (f" (not available here: {', '.join(off)})" if off else "")
            + f"; limits {limits.timeout_s:g} s wall, {limits.cpu_s} s CPU, {limits.memory_mb} MiB, "
            f"{limits.output_bytes} B output. Not a security boundary against hostile code: see docs/tools.md")


def run_python(code: str, limits: Limits = Limits()) -> Result:
    """Run ``code`` in a fresh sandboxed interpreter; never raises for anything the code does."""
    workdir = tempfile.mkdtemp(prefix="rl_tool_")
    limits_literal = repr((limits.memory_mb, limits.cpu_s, limits.output_bytes * 64, limits.max_procs + 1,
                           isolation()["network_namespace"], isolation()["unprivileged_uid"]))
    runner = _RUNNER.replace("__LIMITS__", limits_literal).replace("__CODE__", repr(code))
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", runner], cwd=workdir, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, close_fds=True, start_new_session=True)
    except OSError as e:  # could not even start (e.g. the host is out of processes)
        shutil.rmtree(workdir, ignore_errors=True)
        return Result("", f"start failed: {e}")
    try:
        out, error = _collect(proc, limits)
    finally:
        _kill_group(proc)
        shutil.rmtree(workdir, ignore_errors=True)
    text = out.decode("utf-8", errors="replace")
    if error is None and proc.returncode:
        code_ = proc.returncode
        error = f"signal {-code_}" if code_ < 0 else f"exit {code_}"
    return Result(text, error)


def _collect(proc: subprocess.Popen, limits: Limits) -> tuple[bytes, str | None]:
    """Read the child's output until it exits, the wall clock runs out, or the output is too long."""
    deadline, chunks, size = time.monotonic() + limits.timeout_s, [], 0
    fd = proc.stdout.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"".join(chunks), "timeout"
        ready, _, _ = select.select([fd], [], [], min(left, 0.5))
        if ready:
            data = os.read(fd, 65536)
            if not data:  # EOF: the child closed its output (exited, or closed it and lingers)
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    return b"".join(chunks), "timeout"
                return b"".join(chunks), None
            chunks.append(data)
            size += len(data)
            if size > limits.output_bytes:
                return b"".join(chunks)[: limits.output_bytes], "output_limit"


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the child's whole session (it may have left descendants) and reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover (a zombie that would not die)
        pass
    proc.stdout.close()
