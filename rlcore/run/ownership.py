"""One run owns its ranks and its output directory.

**A rank ends when its launcher ends.** torchrun starts every rank in a session of its own
(torch/distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py:63-68,
``start_new_session=True``), so a ``kill -9`` of torchrun, or of its process group, reaches only
torchrun: the ranks are re-parented and keep training, holding the GPUs and writing into the run
directory a restarted run reads. ``tie_to_launcher`` (torchrun only: a plain ``python`` run keeps
its normal Unix lifetime, so ``nohup`` still works) makes each rank notice within about a second:

- Linux: ``prctl(PR_SET_PDEATHSIG)``, the kernel signals the rank the moment its parent exits,
  whatever killed it. The signal (a real-time one nobody forwards) is blocked in every thread and
  taken by a watcher thread with ``sigtimedwait``, so no library thread swallows it.
- Everywhere (and for a launcher that died before the ``prctl``): the watcher also polls
  ``getppid()``.

The watcher then sends a second signal to the main thread alone (``pthread_kill``: it interrupts a
blocking system call such as a sleep), whose handler raises ``LauncherGone`` (a ``SystemExit`` with
``Exit.ORPHANED``); the main thread ends through the project's exit path
(``rlcore.dist.run_then_exit``: atexit handlers, flushed streams, C++ destructors). Metrics rows and checkpoints are written whole or not at all
(flushed per row; checkpoints renamed when complete), so nothing already written is lost. A main
thread that cannot reach Python code within ``EXIT_GRACE_S`` (blocked in a collective whose peer
already left) is ended by the watcher itself with ``os._exit`` after flushing the streams.

**One writer per output directory.** ``lock_output_dir`` takes an exclusive POSIX lock
(``fcntl.lockf``) on ``{output_dir}/.rlcore.lock`` on global rank 0 for the process's whole life;
the OS drops it when the holder dies, so a crashed or killed run never leaves a stale lock. A second
run on the same directory stops with exit code 2 before it loads anything, naming the holder's host
and pid. POSIX locks work across nodes on NFS (v4, or v3 with lockd) and on Lustre mounted with
``flock``; where the file system refuses locks the run warns and goes on unguarded.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import signal
import socket
import sys
import threading
import time

from rlcore.errors import ConfigError, Exit, describe_errno

PR_SET_PDEATHSIG = 1  # linux/prctl.h
_RT = hasattr(signal, "SIGRTMIN") and hasattr(signal, "sigtimedwait")  # Linux
ORPHAN_SIGNAL = signal.SIGRTMIN + 3 if _RT else None  # the parent-death signal, taken by the watcher
WAKE_SIGNAL = signal.SIGRTMIN + 4 if _RT else signal.SIGUSR2  # watcher -> main thread: raise LauncherGone
POLL_S = 0.5
EXIT_GRACE_S = 10.0
LOCK_NAME = ".rlcore.lock"

_locks: dict[str, int] = {}  # realpath -> fd, open for the life of the process: closing it drops the lock


class LauncherGone(SystemExit):
    """Raised in the main thread when this rank's launcher has died."""

    def __init__(self):
        super().__init__(int(Exit.ORPHANED))


def _say(message: str) -> None:
    os.write(2, (message.rstrip("\n") + "\n").encode())


def under_torchrun(environ=os.environ) -> bool:
    """torchrun (torch elastic) exports TORCHELASTIC_RUN_ID to every rank it starts."""
    return "TORCHELASTIC_RUN_ID" in environ


_launcher = [0]  # the parent this rank was tied to (tie_to_launcher)


def set_parent_death_signal(signum: int) -> bool:
    """Linux: ask the kernel for ``signum`` when the parent exits. False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def tie_to_launcher(rank: int, *, force: bool = False, poll_s: float = POLL_S,
                    grace_s: float = EXIT_GRACE_S) -> bool:
    """Call first thing in a rank (before any thread starts: they inherit the signal mask).
    Returns False (and does nothing) outside torchrun unless ``force``."""
    if not (force or under_torchrun()):
        return False
    launcher = _launcher[0] = os.getppid()
    signal.signal(WAKE_SIGNAL, _raise_launcher_gone)
    if ORPHAN_SIGNAL is not None:
        # A thread started before this call (a library's) does not block it: should the kernel
        # deliver it there, Python's handler runs in the main thread instead of the default action
        # (which would kill the process without the exit path).
        signal.signal(ORPHAN_SIGNAL, _raise_launcher_gone)
        signal.pthread_sigmask(signal.SIG_BLOCK, {ORPHAN_SIGNAL})  # threads started later inherit it
        set_parent_death_signal(ORPHAN_SIGNAL)
    watcher = threading.Thread(target=_watch, args=(launcher, rank, poll_s, grace_s), daemon=True,
                               name="rlcore-launcher-watch")
    watcher.start()
    return True


def _raise_launcher_gone(signum, frame) -> None:
    if signum == ORPHAN_SIGNAL and os.getppid() == _launcher[0]:  # a thread of a live launcher ended
        return
    raise LauncherGone()


def _launcher_gone(launcher: int, poll_s: float) -> bool:
    """Block up to ``poll_s`` (or until the parent-death signal comes): True once the parent changed.
    The signal alone is not proof: the kernel sends it when the *thread* that forked this process
    exits (prctl(2), PR_SET_PDEATHSIG), which a live launcher may do; when the launcher itself
    dies, this process is re-parented before the signal is sent (kernel/exit.c, forget_original_parent),
    so ``getppid()`` already tells."""
    if ORPHAN_SIGNAL is not None:
        signal.sigtimedwait({ORPHAN_SIGNAL}, poll_s)
    else:
        time.sleep(poll_s)
    return os.getppid() != launcher


def _watch(launcher: int, rank: int, poll_s: float, grace_s: float) -> None:
    while not _launcher_gone(launcher, poll_s):
        pass
    _say(f"rank {rank}: its launcher (pid {launcher}) is gone; this rank stops now (exit code "
         f"{int(Exit.ORPHANED)}). Metrics rows and checkpoints already written are complete: start the "
         f"run again with checkpoint.resume=auto.")
    signal.pthread_kill(threading.main_thread().ident, WAKE_SIGNAL)
    time.sleep(grace_s)
    _say(f"rank {rank}: the main thread did not stop within {grace_s:g} s (blocked in a collective?); "
         f"ending the process")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(int(Exit.ORPHANED))


# ----------------------------------------------------------------------------- output directory lock


def _holder(path: str) -> str:
    try:
        with open(path) as f:
            h = json.load(f)
        return f"host {h['host']}, pid {h['pid']}, since {h['started']}"
    except (OSError, ValueError, KeyError):
        return "a process whose details could not be read"


def lock_output_dir(output_dir: str) -> str | None:
    """Take the run's lock on ``output_dir`` (created if needed). Returns None when held (or when
    the file system has no locks: warned), else the message for a second run."""
    path = os.path.realpath(os.path.join(output_dir, LOCK_NAME))
    if path in _locks:  # this process holds it already
        return None
    try:
        os.makedirs(output_dir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        return _unwritable(output_dir, path, e)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EACCES, errno.EAGAIN):
            return (f"trainer.output_dir={output_dir!r} is in use by another run ({_holder(path)}): two runs "
                    f"must not write one directory. Wait for it or stop it (its lock goes with the process), or "
                    f"give this run another trainer.output_dir")
        _say(f"warning: cannot lock {path} ({e.strerror}); a second run on this directory would not be refused")
        return None
    try:  # the holder's details: the run's first write, so a full or read-only disk shows here
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        os.fsync(fd)
    except OSError as e:
        os.close(fd)
        return _unwritable(output_dir, path, e)
    _locks[path] = fd
    return None


def _unwritable(output_dir: str, path: str, e: OSError) -> str:
    return (f"trainer.output_dir={output_dir!r} cannot hold the run's files: writing {e.filename or path} "
            f"failed: {describe_errno(e.errno, e.strerror)}; give a writable directory with room (or free space "
            f"there, or remount it read-write)")


def release_output_dirs() -> None:
    """Drop every lock this process holds (in-process callers that run several configurations,
    e.g. tests; a run keeps its lock until it exits)."""
    while _locks:
        os.close(_locks.popitem()[1])


def claim_output_dir(output_dir: str, rank: int) -> None:
    """Collective: global rank 0 locks ``output_dir``; every rank raises ConfigError if it is taken."""
    from rlcore.dist import all_gather_objects

    problem = lock_output_dir(output_dir) if rank == 0 else None
    problem = all_gather_objects(problem)[0]
    if problem:
        raise ConfigError(problem)
