"""The exit codes of train_grpo.py (per rank), in one table, and the one way to stop on a user error
(``ConfigError``, ``check``, ``fail``).

torchrun itself exits 1 whenever a rank fails or it was signalled, and lists the ranks' codes.
The README's table is this one.
"""

from __future__ import annotations

import sys
from enum import IntEnum


class Exit(IntEnum):
    OK = 0  # trainer.total_steps reached
    CONFIG = 2  # bad configuration or input data, reported before any model loads (or at the bad row)
    NON_FINITE = 3  # trainer.max_consecutive_skips steps in a row had a non-finite loss or gradient norm
    SYNC_MISMATCH = 4  # rollout.check_sync=strict: after a weight sync vLLM scored the probe unlike the trainer
    AGENT_FAILURES = 5  # rollout.agent: more than max_failure_frac of a step's episodes failed (the agent is broken)
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
