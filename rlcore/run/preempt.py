"""Runs that end on purpose: stop signals agreed on by every rank, a hard deadline, per-phase
watchdog messages, and the process exit codes.

SIGTERM (what torchrun forwards, and what Slurm sends on preemption) and SIGUSR1 (Slurm's
``--signal``) only set a flag. The trainer asks ``StopRequest.agreed()`` at phase boundaries; that
is a collective (one all-reduce of the flag), so a signal that reached a single rank still stops
every rank at the same boundary, and they write one checkpoint together. If the run has not exited
``grace_s`` seconds after the first signal (a hung collective, a phase far longer than the grace),
a timer thread ends the process with ``Exit.GRACE_EXPIRED``: the last complete checkpoint is still
valid, since checkpoints are written atomically.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager

from rlcore.dist import all_reduce_sum
from rlcore.errors import Exit
from rlcore.run import storage


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def _say(message: str) -> None:
    """Write one line to stderr without Python's buffered IO (safe inside a signal handler)."""
    os.write(2, (message.rstrip("\n") + "\n").encode())


class StopRequest:
    """The stop flag of this rank, set by a signal, and the collective decision to act on it."""

    def __init__(self, grace_s: float, rank: int = 0, signals=STOP_SIGNALS):
        self.grace_s, self.rank = grace_s, rank
        self.signum: int | None = None
        self.received_at: float | None = None
        self._timer: threading.Timer | None = None
        self._signals = signals

    def install(self) -> "StopRequest":
        for sig in self._signals:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            return  # torchrun and Slurm may both deliver it: the first one counts
        self.signum, self.received_at = signum, time.monotonic()
        if storage.failed():  # the disk that failed is not written again; the run is ending on it
            _say(f"rank {self.rank}: received {signal.Signals(signum).name} after a failed write of the run: "
                 f"no checkpoint is attempted; exiting with code {int(Exit.STORAGE)} (the message above says "
                 f"what is intact)")
        else:
            _say(f"rank {self.rank}: received {signal.Signals(signum).name}; finishing the current phase, "
                 f"then checkpointing and exiting (deadline trainer.preempt_grace_s={self.grace_s:g} s)")
        self._timer = threading.Timer(self.grace_s, self._deadline)
        self._timer.daemon = True
        self._timer.start()

    def _deadline(self) -> None:
        _say(f"rank {self.rank}: no checkpoint within trainer.preempt_grace_s={self.grace_s:g} s of the stop "
             f"signal; exiting with code {int(Exit.GRACE_EXPIRED)}. The last complete checkpoint is intact: "
             f"resume with checkpoint.resume=auto, and raise trainer.preempt_grace_s (and the time given "
             f"by Slurm's --signal / torchrun's --shutdown-timeout) if phases take longer.")
        os._exit(Exit.GRACE_EXPIRED)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def agreed(self) -> bool:
        """Collective: True on every rank when any rank received a stop signal."""
        return all_reduce_sum([1.0 if self.requested else 0.0])[0] > 0

    def seconds_since_signal(self) -> float | None:
        return None if self.received_at is None else time.monotonic() - self.received_at

    def cancel_deadline(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class Watchdog:
    """A daemon thread that reports a phase running longer than ``threshold_s`` (and again every
    further ``threshold_s``), naming the phase and the rank. It only reports: turning a hung
    collective into an error is the process-group timeout's job (parallel.timeout_s)."""

    def __init__(self, rank: int, threshold_s: float, pg_timeout_s: float):
        self.rank, self.threshold_s, self.pg_timeout_s = rank, threshold_s, pg_timeout_s
        self._phase: str | None = None
        self._started = 0.0
        self._reports = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if threshold_s > 0:
            self._thread = threading.Thread(target=self._loop, name="rlcore-watchdog", daemon=True)
            self._thread.start()

    @contextmanager
    def phase(self, name: str):
        with self._lock:
            self._phase, self._started, self._reports = name, time.monotonic(), 0
        try:
            yield
        finally:
            with self._lock:
                self._phase = None

    def _loop(self) -> None:
        poll = min(max(self.threshold_s / 4, 0.05), 5.0)
        while not self._stop.wait(poll):
            with self._lock:
                if self._phase is None:
                    continue
                elapsed = time.monotonic() - self._started
                if elapsed < self.threshold_s * (self._reports + 1):
                    continue
                self._reports += 1
                phase = self._phase
            _say(f"watchdog: rank {self.rank} has been in phase '{phase}' for {elapsed:.1f} s "
                 f"(trainer.watchdog_s={self.threshold_s:g}); if another rank died or hangs, the collective "
                 f"waiting for it fails after parallel.timeout_s={self.pg_timeout_s:g} s")

    def close(self) -> None:
        self._stop.set()
