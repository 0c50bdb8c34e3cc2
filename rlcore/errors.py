"""The exit codes of train_grpo.py (per rank), in one table; the one way to stop on a user error
(``ConfigError``, ``check``, ``fail``); and what a failed write of the run becomes (``StorageError``,
``writing``).

torchrun itself exits 1 whenever a rank fails or it was signalled, and lists the ranks' codes.
The README's table is this one.

**Failed writes.** Every write of a run (checkpoint files, ``latest``, metrics.jsonl, the trackers'
files, validation samples, HF exports, the ownership lock) runs inside ``writing(what, path)``: an
``OSError`` that says the storage failed (``STORAGE_ERRNOS``: full, over quota, read-only, refused,
gone, I/O error), wherever it hides (the exception itself, its cause, or DCP's ``CheckpointException``
that carries every rank's failure), becomes a ``StorageError`` naming what was being written. Inside
a *deferred* block (``deferred()``, opened by ``rlcore.run.storage`` around a rank's own writes
inside a collective sequence, e.g. rank 0 writing an HF export while every rank gathers its
tensors) the failure is recorded instead and the block's body is left, so the rank keeps taking
part in every collective; the ranks then agree on the recorded failures together
(``rlcore.run.storage.agree``) and end with ``Exit.STORAGE``.
"""

from __future__ import annotations

import errno
import os
import re
import sys
from contextlib import contextmanager
from enum import IntEnum


class Exit(IntEnum):
    OK = 0  # trainer.total_steps reached
    CONFIG = 2  # bad configuration or input data, reported before any model loads (or at the bad row)
    NON_FINITE = 3  # trainer.max_consecutive_skips steps in a row had a non-finite loss or gradient norm
    SYNC_MISMATCH = 4  # rollout.check_sync=strict: after a weight sync vLLM scored the probe unlike the trainer
    AGENT_FAILURES = 5  # rollout.agent: more than max_failure_frac of a step's episodes failed (the agent is broken)
    STORAGE = 74  # a write of the run failed (disk full, quota, read-only, gone, I/O error) or a checkpoint has no
    # room: one message says what failed and what is intact; resume with checkpoint.resume=auto (sysexits' EX_IOERR)
    PREEMPTED = 75  # stopped by SIGTERM/SIGUSR1 after writing a checkpoint: resume with checkpoint.resume=auto
    GRACE_EXPIRED = 76  # stop signal, but no checkpoint within trainer.preempt_grace_s: the previous one is intact
    ORPHANED = 77  # the launcher (torchrun) died, e.g. kill -9: the rank ended itself (rlcore/run/ownership.py)


class ConfigError(ValueError):
    """A user mistake in the configuration or inputs; printed without a traceback, exit code 2."""


def fail(message: str, code: Exit = Exit.CONFIG) -> None:
    """Print a user-facing error (every rank may print it) and exit with ``code``."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(int(code))


def check(ok: bool, key: str, value, fix: str) -> None:
    """A config check: ``key=value is invalid: fix`` (the key, the value and how to fix it)."""
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {fix}")


def check_positive(section: str, obj, *names: str) -> None:
    """Each named field of ``obj`` is None or > 0 (``section.name=value is invalid: it must be > 0``)."""
    for name in names:
        value = getattr(obj, name)
        check(value is None or value > 0, f"{section}.{name}", value, "it must be > 0")


# ----------------------------------------------------------------------------- failed writes

# What says the storage failed rather than the program: full, over quota, read-only, refused, a
# folder gone (the output directory deleted or unmounted), an I/O error, a stale NFS handle, a FUSE
# mount gone, a file over the filesystem's size limit.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT,
                            errno.EIO, errno.ESTALE, errno.ENOTCONN, errno.EFBIG})


class StorageError(Exception):
    """A write of the run failed for a storage reason: ``what`` was being written to ``path``;
    ``errno``/``strerror`` as the OS said; ``rank``: the rank whose write it was, when another
    rank's failure reached this one (DCP reports every rank's failure to all)."""

    def __init__(self, what: str, path: str | None, errno_: int, strerror: str, rank: int | None = None):
        super().__init__(what, path, errno_, strerror, rank)
        self.what, self.path, self.errno, self.strerror, self.rank = what, path, errno_, strerror, rank

    def __str__(self) -> str:
        return f"writing {self.what} failed: {self.path}: {describe_errno(self.errno, self.strerror)}"


def describe_errno(code: int, strerror: str | None = None) -> str:
    """``[Errno 28] No space left on device (ENOSPC)``."""
    return f"[Errno {code}] {strerror or os.strerror(code)} ({errno.errorcode.get(code, '?')})"


def storage_oserror(exc: BaseException) -> tuple[OSError, int | None] | None:
    """(the OSError with a storage errno behind ``exc``, the rank it happened on when that is
    another's): ``exc`` itself, its cause or context, or one of the per-rank failures a DCP
    ``CheckpointException`` carries (``failures``: rank -> (exception, traceback)); None when the
    failure is not the storage's."""
    stack, seen = [(exc, None)], set()
    while stack:
        e, rank = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return e, rank
        code = re.search(r"\(os error (\d+)\)", str(e))  # Rust's io::Error (safetensors): no errno attribute
        if code and int(code.group(1)) in STORAGE_ERRNOS:
            return OSError(int(code.group(1)), os.strerror(int(code.group(1)))), rank
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack += [(f[0] if isinstance(f, tuple) else f, r) for r, f in failures.items()]
        stack += [(e.__context__, rank), (e.__cause__, rank)]
    return None


def full_or_read_only(path: str | None, exc: BaseException) -> tuple[int, str] | None:
    """(errno, what the OS would have said) for a write that failed without an errno while
    ``path``'s filesystem is read-only or (almost) full: torch's zip writer turns a short write
    into ``RuntimeError: ... unexpected pos``, even inside DCP's save. None otherwise."""
    if not path:
        return None
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        st = os.statvfs(probe)
    except OSError:
        return None
    said = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if st.f_flag & os.ST_RDONLY:
        return errno.EROFS, f"Read-only file system (the write said {said})"
    free = st.f_bavail * st.f_frsize
    if free < min(1 << 20, st.f_blocks * st.f_frsize // 100):
        return errno.ENOSPC, f"No space left on device ({free} bytes free after the write said {said})"
    return None


_pending: list[StorageError] = []  # this rank's failed writes inside deferred blocks, until the ranks agree
_deferring = [0]  # depth of deferred() blocks


@contextmanager
def deferred():
    """Failed writes in this block are recorded (``pending()``), not raised: see the module docstring."""
    _deferring[0] += 1
    try:
        yield
    finally:
        _deferring[0] -= 1


def pending() -> list[StorageError]:
    """This rank's recorded failures (a writer that streams stops writing once there is one)."""
    return _pending


def require_folder(path: str) -> None:
    """The run's output folder must still be there: a write never makes it again (an unmounted
    filesystem would leave its empty mount point, and the run would fill the disk under it)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(errno.ENOENT, "the run's output folder is gone", path)


def as_storage_error(exc: BaseException, what: str, path: str | None) -> StorageError | None:
    """``exc`` as the failed write ``what`` to ``path``, or None when the storage is not why:
    the errno found behind it (``storage_oserror``), else a filesystem found read-only or full."""
    found = storage_oserror(exc)
    if found is not None:
        cause, rank = found
        name = os.fsdecode(cause.filename) if cause.filename is not None else path
        return StorageError(what, name, cause.errno, cause.strerror, rank)
    if isinstance(exc, (KeyboardInterrupt, SystemExit)) or (inferred := full_or_read_only(path, exc)) is None:
        return None
    failures = getattr(exc, "failures", None)  # DCP's: the ranks whose writes failed
    return StorageError(what, path, *inferred, min(failures) if isinstance(failures, dict) else None)


def record(err: StorageError) -> None:
    """A failed write this rank's ranks must agree on (``deferred``), from wherever it was seen."""
    _pending.append(err)


@contextmanager
def writing(what: str, path: str | None = None):
    """A write of the run: a storage failure inside becomes ``StorageError(what, path, ...)``,
    raised, or recorded inside ``deferred()`` (the rest of the body is skipped either way)."""
    try:
        yield
    except StorageError as e:
        if not _deferring[0]:
            raise
        record(e)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        err = as_storage_error(e, what, path)
        if err is None:
            raise
        err.__cause__ = e
        if not _deferring[0]:
            raise err from e
        record(err)
