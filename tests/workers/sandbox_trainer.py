"""A stand-in trainer rank for tests/test_sandbox.py: it holds a secret in its environment, sends one
piece of hostile code through ``rlcore.agent.tools.run_call`` (the agent loop's path) and reports, as
one JSON line, whether the code got out. Run as its own process so that code which kills "the
trainer" kills this process, never pytest.

    python tests/workers/sandbox_trainer.py BACKEND CASE[,CASE...] WORKDIR [PYTHON]

WORKDIR holds what the test prepared: ``token`` (a 0600 file standing in for
~/.cache/huggingface/token) and ``out/`` (a 0755 directory of the trainer's user standing in for the
checkout or output directory). One JSON line per case, {"case", "escaped": bool, ...}; killed by a
signal = escaped.
"""

from __future__ import annotations

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import json
import os
import socket
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

# Starts a process through _posixsubprocess.fork_exec, the C spawn path under subprocess.Popen: it
# raises no audit event of its own in CPython 3.11, so the audit hook never sees it.
SPAWN = r'''
import _posixsubprocess, os, sys
def spawn(argv, setsid=True):
    r, w = os.pipe()
    exe = [os.fsencode(argv[0])]
    pid = _posixsubprocess.fork_exec(argv, exe, True, (w,), None, None, -1, -1, -1, -1, -1, -1, r, w,
                                     False, setsid, -1, None, None, None, -1, None, False)
    os.close(w)
    os.read(r, 100)  # exec done (or failed)
    os.close(r)
    return pid
def wait(pid):
    return os.waitpid(pid, 0)[1]
'''

CASES = {
    # a process in its own session (the process-group kill misses it) and one in the call's group
    "outlive": SPAWN + "spawn(['/bin/sh', '-c', 'exec sleep 31.{token}'])\n"
                       "spawn(['/bin/sh', '-c', 'exec sleep 32.{token}'], setsid=False)\nprint('spawned')",
    # a shell is not under the audit hook
    "write_outside": SPAWN + "print(wait(spawn(['/bin/sh', '-c', 'echo pwned > {out}/pwned.txt'])))",
    # same uid as the trainer: a signal reaches it
    "kill_trainer": SPAWN + "print(wait(spawn(['/bin/sh', '-c', 'kill -9 {trainer_pid}'])))",
    # /proc/<pid>/environ of every process this code can see, the trainer's among them
    "proc_environ": "import os\nfor p in [{trainer_pid}] + [int(x) for x in os.listdir('/proc') if x.isdigit()]:\n"
                    "    try:\n        e = open(f'/proc/{{p}}/environ', 'rb').read()\n    except OSError:\n"
                    "        continue\n    if b'RLCORE_TRAINER_SECRET' in e:\n        print(p, e[:4000])",
    # a 0600 file of the trainer's user
    "read_token": "print(open('{token_file}').read())",
    # a connection to 127.0.0.1 where the trainer listens, from a fresh interpreter (no audit hook)
    "network": SPAWN + "import sys\nprint(wait(spawn([sys.executable, '-I', '-S', '-c', "
                       "'import socket; socket.create_connection((\"127.0.0.1\", {port}), timeout=2)'])))",
}


def _listener() -> tuple[int, list]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    accepted: list = []

    def serve():
        srv.settimeout(30)
        try:
            while True:
                conn, _ = srv.accept()
                accepted.append(1)
                conn.close()
        except OSError:
            pass

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1], accepted


def _processes_with(token: str) -> list[int]:
    found = []
    for p in (x for x in os.listdir("/proc") if x.isdigit()):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(p))
        except OSError:
            pass
    return found


def run_case(case: str, backend: str, workdir: str, python: str | None) -> dict:
    from rlcore.agent import sandbox
    from rlcore.agent.tools import Tool, python as python_tool, run_call

    token = f"{os.getpid()}{len(case)}"
    port, accepted = _listener()
    token_file = os.path.join(workdir, "token")
    code = CASES[case].format(token=token, out=os.path.join(workdir, "out"), trainer_pid=os.getpid(),
                              token_file=token_file, port=port)
    kwargs = {} if backend == "legacy" else {"backend": backend, "python": python}
    # max_procs > 0: the spawns succeed, so what is tested is the OS boundary, not RLIMIT_NPROC
    limits = sandbox.Limits(timeout_s=10.0, cpu_s=5, memory_mb=512, output_bytes=65536, max_procs=16, **kwargs)
    tool = Tool("python", python_tool, {"type": "function", "function": {"name": "python"}}, sandboxed=True)
    result = run_call(tool, "python", {"code": code}, limits)
    time.sleep(0.3)  # anything left behind has had time to act
    secret = os.environ.get("RLCORE_TRAINER_SECRET", "")
    with open(token_file) as f:
        token_text = f.read().strip()
    left = _processes_with(f"31.{token}") + _processes_with(f"32.{token}")
    escaped = {
        "outlive": bool(left),
        "write_outside": os.path.exists(os.path.join(workdir, "out", "pwned.txt")),
        "kill_trainer": False,  # had it worked, this process would be dead
        "proc_environ": bool(secret) and secret in result.content,
        "read_token": token_text in result.content,
        "network": bool(accepted),
    }[case]
    for pid in left:  # leave nothing behind
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    return {"case": case, "escaped": escaped, "error": result.error, "content": result.content[-600:]}


def main() -> None:
    backend, cases, workdir = sys.argv[1:4]
    python = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] else None
    for case in cases.split(","):
        print(json.dumps(run_case(case, backend, workdir, python)), flush=True)


if __name__ == "__main__":
    main()
