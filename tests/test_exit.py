"""How a rank ends: ``rlcore.dist.run_then_exit`` / ``exit_process`` (see its docstring for the gloo
abort at interpreter exit they avoid). Each case is a real Python process; what is checked is what
a caller of ``torchrun`` sees: the exit status, that atexit handlers ran, that buffered output is
not lost, and that errors still print."""

import os
import subprocess
import sys

import pytest


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROGRAM = """
import atexit, sys
from rlcore.dist import run_then_exit
atexit.register(lambda: print("atexit ran", file=sys.stderr))

class Finalized:
    def __del__(self):  # runs only if the interpreter finalizes
        print("finalized", file=sys.stderr)

keep = Finalized()

def main():
    print("buffered, no newline", end="")  # stdout is a pipe: block-buffered, so flushing matters
    {body}

run_then_exit(main)
"""


def run(body: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("PYTHONUNBUFFERED", None)
    return subprocess.run([sys.executable, "-c", PROGRAM.format(body=body)], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("body, code, stderr_has", [
    ("pass", 0, None),
    ("raise SystemExit(3)", 3, None),  # Exit.NON_FINITE keeps its code
    ("sys.exit(None)", 0, None),
    ("sys.exit('error: bad thing')", 1, "error: bad thing"),  # printed, as Python does
    ("raise ValueError('boom')", 1, "ValueError: boom"),  # the traceback still prints
    ("raise KeyboardInterrupt", 130, "KeyboardInterrupt"),
])
def test_exit_code_output_and_atexit(body, code, stderr_has):
    proc = run(body)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == "buffered, no newline", proc.stdout
    assert "atexit ran" in proc.stderr
    assert "finalized" not in proc.stderr  # the interpreter's finalization is skipped
    if stderr_has:
        assert stderr_has in proc.stderr, proc.stderr
        assert proc.stderr.index(stderr_has) < proc.stderr.index("atexit ran")


@pytest.mark.unit
def test_stale_cpu_shm_files_are_removed_unless_a_process_maps_them():
    """A killed tp=2 run leaves /dev/shm/*cpushm* files; the next engine start removes only those
    no live process maps."""
    import mmap

    from rlcore.rollout.cpu_kv import remove_stale_cpu_shm

    stale, live = "/dev/shm/rlcore-test-cpushm_stale", "/dev/shm/rlcore-test-cpushm_live"
    for path in (stale, live):
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
    with open(live, "r+b") as f, mmap.mmap(f.fileno(), 4096):
        removed = remove_stale_cpu_shm()
        assert stale in removed and live not in removed and os.path.exists(live)
    os.unlink(live)
    assert not os.path.exists(stale)
