"""A torchrun-like launcher for the test harnesses in tests/workers/, forked from an interpreter that
has already imported the stack (a "zygote", as Android and multiprocessing's forkserver call it).

Why: the suite is CPU-bound on the 2-core CI machine and most of a short launch is imports: each
rank of a cold ``python -u worker.py`` spends 3.5-6 s of CPU importing torch, transformers, VeOmni
and vLLM, and torchrun's agent 1.2 s importing torch. A forked rank inherits those modules; a
2-rank launch of ``grad_invariance.py`` measured 24.2 CPU-s under torchrun and 16.9 forked here,
with bit-identical gradients (docs/testing.md).

What stays real: ranks are separate processes, torch.distributed runs on gloo through ``env://``
(the store is rank 0's, where torchrun's agent hosts it: TORCHELASTIC_USE_AGENT_STORE is the one
variable of torchrun's left unset), each rank gets torchrun's environment (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID, ...),
``sys.argv``, ``sys.path[0]`` and ``__main__`` as ``python -u script`` would set them, and a rank
that fails ends the others (SIGTERM, then SIGKILL after 30 s) as torchrun's agent does. What is
not exercised here is a cold start and torchrun's agent itself: the tests of those (the whole loop
as a user starts it, exact resume across cold restarts, signals, kill -9, exit codes, multi-node)
always launch under the real torchrun (``conftest.COLD_FILES``, ``workers/launch.py``), and
``RLCORE_TEST_LAUNCHER=torchrun`` sends every launch there.

Protocol (one Unix socket per pytest process): the client sends one JSON request with two file
descriptors (stdout, stderr) attached; the zygote forks a launcher, which replies with its pid,
runs the ranks, and replies with its exit status (0 when every rank exited 0, else 1, as torchrun).
"""

from __future__ import annotations

import gc

gc.disable()  # the zygote's heap is frozen once imported; forked ranks set their own collector

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

# What every worker imports anyway (a rank that needs less pays nothing for the rest: it is shared).
# The lazily imported ones are what a CPU rank's engine builds import (python -X importtime of a demo rank).
PRELOAD = (
    "torch", "torch.distributed", "torch.distributed.tensor", "torch.utils.tensorboard", "transformers",
    "transformers.modeling_utils", "vllm", "vllm.config", "vllm.engine.arg_utils", "vllm.entrypoints.pooling.offline",
    "vllm.v1.worker.cpu_model_runner", "vllm.v1.worker.gpu_worker", "vllm.v1.sample.ops.penalties",
    "vllm.model_executor.layers.rotary_embedding", "veomni", "veomni.distributed.torch_parallelize",
    "rlcore.engine_veomni", "rlcore.colocate_rollout", "rlcore.algo.grpo", "rlcore.run.build",
)
STOP_GRACE_S = 30.0  # torchrun's agent: SIGTERM the other ranks, SIGKILL what is left after this


# ----------------------------------------------------------------------------- the client


class Zygote:
    """One pre-imported interpreter per pytest process, started on first use."""

    def __init__(self, repo: str, env: dict):
        self.repo, self.env = repo, env
        self.proc: subprocess.Popen | None = None
        self.folder = self.path = self.log = ""

    def _start(self) -> None:
        import tempfile

        self.folder = tempfile.mkdtemp(prefix="rlcore_zygote_")
        self.path, self.log = os.path.join(self.folder, "sock"), os.path.join(self.folder, "zygote.log")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-u", os.path.abspath(__file__), self.path],
                                         cwd=self.repo, env=self.env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the launch zygote did not start:\n{self._log_tail()}")
            time.sleep(0.05)

    def _log_tail(self) -> str:
        try:
            with open(self.log) as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def run(self, script: str, nproc: int, args: list[str], env: dict, cwd: str,
            timeout: float) -> subprocess.CompletedProcess:
        """``python -m torch.distributed.run --nproc_per_node=nproc script *args``, forked."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            request = {"script": script, "nproc": nproc, "args": args, "env": env, "cwd": cwd}
            socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [out_w, err_w])
        finally:
            os.close(out_w)
            os.close(err_w)
        with conn:
            reader = conn.makefile("r")
            pid = int(reader.readline() or 0)
            if not pid:  # the zygote died before it forked the launcher
                os.close(out_r)
                os.close(err_r)
                raise RuntimeError(f"the launch zygote did not fork {script}:\n{self._log_tail()}")
            stdout, stderr = _drain(out_r, err_r, pid, timeout, [script, *args])
            conn.settimeout(max(1.0, timeout))
            line = reader.readline()  # the launcher's exit status; nothing if it was killed
        code = int(line) if line.strip() else -signal.SIGKILL
        return subprocess.CompletedProcess([script, *args], code, stdout, stderr)

    def close(self) -> None:
        import shutil

        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)


def _drain(out_r: int, err_r: int, pid: int, timeout: float, cmd: list[str]) -> tuple[str, str]:
    """Both pipes until every writer closed them (the launcher and its ranks ended); on timeout
    the launcher's process group is killed and ``subprocess.TimeoutExpired`` raised, as
    ``subprocess.run`` does."""
    import selectors

    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    sel = selectors.DefaultSelector()
    for fd in chunks:
        sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                raise subprocess.TimeoutExpired(cmd, timeout, b"".join(chunks[out_r]), b"".join(chunks[err_r]))
            for key, _ in sel.select(timeout=min(left, 1.0)):
                data = os.read(key.fd, 65536)
                if data:
                    chunks[key.fd].append(data)
                else:
                    sel.unregister(key.fd)
    finally:
        sel.close()
        os.close(out_r)
        os.close(err_r)
    return tuple(b"".join(chunks[fd]).decode(errors="replace") for fd in (out_r, err_r))


# ----------------------------------------------------------------------------- the zygote


def serve(path: str) -> None:
    import importlib

    from rlcore.run.ownership import set_parent_death_signal

    set_parent_death_signal(signal.SIGKILL)  # the pytest process that started it is gone: so is it
    # vllm 0.23's model layers import pandas (vllm/_aiter_ops.py:22), pandas imports pyarrow, and pyarrow's
    # jemalloc starts its purging thread ("jemalloc_bg_thd") at the first allocation; without it jemalloc
    # purges on the allocating threads instead. Read when pyarrow loads: set before the imports.
    os.environ.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")
    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()  # what the imports made: out of every forked rank's collections
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:  # a fork copies only the calling thread: a lock another one held stays held
        raise SystemExit(f"zygote: {threads} threads after the imports; forking them is unsafe")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # launchers are reaped by the kernel
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    server.listen(16)
    os.rename(path + ".tmp", path)  # the client waits for this name: the socket is listening
    while True:
        conn, _ = server.accept()
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
        while not msg.endswith(b"\n"):
            msg += conn.recv(1 << 20)
        if os.fork() == 0:
            server.close()
            _launcher(conn, json.loads(msg), fds)  # never returns
        conn.close()
        for fd in fds:
            os.close(fd)


def _launcher(conn: socket.socket, req: dict, fds: list[int]) -> None:
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()  # its own process group: a timeout kills the launcher and its ranks together
        conn.sendall(f"{os.getpid()}\n".encode())
        devnull = os.open(os.devnull, os.O_RDONLY)
        for src, dst in ((devnull, 0), (fds[0], 1), (fds[1], 2)):
            os.dup2(src, dst)
        for fd in (devnull, *fds):
            os.close(fd)
        os.chdir(req["cwd"])
        _set_environ(req["env"])
        code = _run_ranks(req["script"], req["nproc"], req["args"])
    except BaseException:  # noqa: BLE001 - reported, then the launch failed
        import traceback

        traceback.print_exc()
    finally:
        try:
            conn.sendall(f"{code}\n".encode())
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def _set_environ(env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)


def _run_ranks(script: str, nproc: int, args: list[str]) -> int:
    """torchrun --standalone's job: a free port, one process per rank with torchrun's variables,
    the first failure ends the others."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_id = f"forklaunch-{os.getpid()}"
    pids = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _rank(script, args, rank, nproc, port, run_id)
        pids[pid] = rank
    failed, deadline = None, None
    while pids:
        if deadline is not None and time.monotonic() > deadline:
            for pid in pids:
                _signal(pid, signal.SIGKILL)
            deadline = float("inf")
        pid, status = os.waitpid(-1, os.WNOHANG) if deadline is not None else os.waitpid(-1, 0)
        if pid == 0:
            time.sleep(0.1)
            continue
        rank = pids.pop(pid, None)
        if rank is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and failed is None:
            failed = (rank, pid, code)
            print(f"forklaunch: rank {rank} (pid {pid}) exited {code}; stopping the others", file=sys.stderr)
            for other in pids:
                _signal(other, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
    return 0 if failed is None else 1


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _rank(script: str, args: list[str], rank: int, nproc: int, port: int, run_id: str) -> None:
    """One rank: ``python -u script args`` with torchrun's environment, in this forked interpreter."""
    import runpy

    code = 1
    try:
        os.environ.update({
            "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "localhost",
            "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        })
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default with more than one rank
        sys.argv = [script, *args]
        pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.path.dirname(os.path.abspath(script)), *pythonpath,
                       *(p for p in sys.path[1:] if p not in pythonpath)]
        gc.enable()  # as in a cold interpreter (the zygote's own heap stays frozen)
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException as e:  # noqa: BLE001 - printed as Python prints an uncaught exception
        sys.excepthook(type(e), e, e.__traceback__)
    finally:
        from rlcore.dist import exit_process

        exit_process(code)  # atexit handlers, flushed streams, the C library's exit: as a rank ends


if __name__ == "__main__":
    serve(sys.argv[1])
