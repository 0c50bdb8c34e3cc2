"""Keep third-party noise out of the console, and nothing else.

Building the engines prints lines that read like failures but are not: transformers' docstring
check prints ``[ERROR] `cache_position` is part of Qwen3ForCausalLM.forward's signature, but not
documented`` when VeOmni's patched model is imported (transformers/utils/auto_docstring.py:4110, a
plain ``print``); vLLM's CPU build logs "Triton is installed, but doesn't include CPU backend"
(vllm/triton_utils/importing.py:44); vLLM's CPU worker binds memory to a NUMA node and torch's C++
prints "Warning: NUMA binding: Using MEMBIND policy ..." straight to file descriptor 2
(vllm/v1/worker/cpu_worker.py:70); checkpoint loading draws progress bars; and third-party code
raises FutureWarnings about torch APIs.

``install()`` sets the quiet/offline environment and ignores FutureWarning / DeprecationWarning
raised from outside this project. ``filtered_output()`` wraps the engine builds: file descriptors
1 and 2 go through a pipe whose reader drops the lines matching ``NOISE`` and forwards every other
line as it arrives (so a hang or a real error still shows at once, C++ output included).
"""

from __future__ import annotations

import os
import re
import sys
import threading
import warnings
from contextlib import contextmanager

ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "ERROR", "VEOMNI_VERBOSITY": "ERROR", "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
    # No network at run time: vLLM otherwise posts usage statistics to stats.vllm.ai from its workers.
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
}

# Lines (or carriage-return segments of progress bars) that are noise, never a problem.
NOISE = tuple(re.compile(p) for p in (
    r"^\[ERROR\] `\w+` is part of \S+ signature, but not documented",
    r"^\[ERROR\] `\w+` is part of \S+, but not documented",
    r"Triton is installed, but doesn't include CPU backend",
    r"Warning: NUMA binding: Using MEMBIND policy",
    r"^Loading checkpoint shards:",
    r"^Writing model shards:",
))


def install() -> None:
    """Environment defaults (a user's own setting wins) and warning filters; call before the
    heavy imports."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    # module= is matched against the module that raised the warning: ours still show.
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"^(?!rlcore|train_grpo|__main__)")


def is_noise(line: str) -> bool:
    return any(p.search(line) for p in NOISE)


def filter_text(text: str) -> str:
    """``text`` without its noise lines (progress-bar segments split at carriage returns)."""
    out = []
    for line in text.splitlines(keepends=True):
        segments = [s for s in re.split(r"(?<=\r)", line) if s]
        kept = [s for s in segments if not is_noise(s.strip("\r\n"))]
        if len(kept) == len(segments):
            out.append(line)  # untouched, blank lines included
        elif "".join(kept).strip("\r\n"):
            out.append("".join(kept).rstrip("\r\n") + "\n")
    return "".join(out)


class _Forwarder(threading.Thread):
    """Reads one pipe line by line and writes the non-noise lines to ``out_fd``."""

    def __init__(self, read_fd: int, out_fd: int):
        super().__init__(daemon=True, name=f"quiet-fd{out_fd}")
        self.read_fd, self.out_fd = read_fd, out_fd

    def run(self) -> None:
        pending = b""
        with os.fdopen(self.read_fd, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                pending += chunk
                head, sep, pending = pending.rpartition(b"\n")
                if sep:
                    self._write(filter_text((head + sep).decode(errors="replace")))
        if pending:
            self._write(filter_text(pending.decode(errors="replace")))

    def _write(self, text: str) -> None:
        if text:
            os.write(self.out_fd, text.encode())


@contextmanager
def filtered_output():
    """Route fds 1 and 2 through noise filters for the duration (see the module docstring)."""
    if os.environ.get("RLCORE_SHOW_ALL_OUTPUT") == "1":  # debugging: see everything
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved, threads = {}, []
    for fd in (1, 2):
        read_fd, write_fd = os.pipe()
        saved[fd] = os.dup(fd)
        forwarder = _Forwarder(read_fd, os.dup(saved[fd]))
        forwarder.start()
        os.dup2(write_fd, fd)
        os.close(write_fd)
        threads.append(forwarder)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in (1, 2):
            os.dup2(saved[fd], fd)  # closes the pipe's last write end we hold: the reader sees EOF
            os.close(saved[fd])
        for forwarder in threads:
            # A child process that inherited the pipe (e.g. a compile worker) may keep it open:
            # do not wait for it; the daemon thread goes on forwarding what it writes later.
            forwarder.join(timeout=1)
