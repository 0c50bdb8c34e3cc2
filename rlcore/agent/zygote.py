"""The agent workers' zygote: a fresh interpreter (started by path, not forked from the trainer, which
holds a vLLM engine and torch's threads) that imports the user's agent once and forks the worker
processes that run its episodes. Standard library only: it imports nothing of rlcore, so a user's
module starts fast.

    python zygote.py        # by rlcore.agent.workers.ProcessRunner; JSON lines both ways

stdin, first line: ``{"entry": "path.py:fn" | "pkg.module:fn", "sys_path": [...], "preload": [...],
"kwargs": {...}}``; the answer is ``{"ready": true}`` or ``{"error": "..."}``. Then commands:
``{"op": "run", "id": k, "call": {...}}`` runs ``fn(**call, **kwargs)`` (an ``async def`` through
``asyncio.run``) in an idle worker, or a newly forked one, and ``{"op": "kill", "id": k}`` kills the
process group of the worker running episode k. stdout: one ``{"id": k, "ok": bool, "reward": float |
null, "error": str | null}`` per run, whatever the episode did (returned, raised, ended its process,
was killed, crashed). On stdin's end (the trainer exited or died) every worker is killed and the
zygote exits.

A worker runs one episode at a time and then the next one it is given (a killed or dead worker is not
replaced until an episode needs one); it runs in its own session (the subprocesses an episode starts
die with it on a kill), dies with the zygote (PR_SET_PDEATHSIG), has stdin closed and its stdout sent
to stderr (the protocol's pipes are not its).

Before the first fork the zygote warms the ``openai`` client (one chat and one text completion against
a canned local server, then closed: the SDK builds its request and response machinery lazily, about
30-60 ms of CPU that every worker would otherwise pay again) and freezes its heap (``gc.freeze``: a
worker's collections then leave the parent's objects, and their copy-on-write pages, alone). Measured
here, a fresh process's CPU for a two-request episode: 96 -> 37 ms with its client made in the episode
(25 ms of that is the client's TLS context), 45 -> 13 ms with a module-level client (rlcore/demo/agent.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import select
import signal
import sys
import traceback

_PR_SET_PDEATHSIG = 1
CRASHED = "the agent's process"  # how the report of an episode whose worker died begins


def load_entry(ref: str):
    """``path/to/file.py:fn`` (loaded by path, without importing its package) or ``pkg.module:fn``."""
    where, _, name = ref.rpartition(":")
    if not where or not name:
        raise ValueError(f"{ref!r}: give path/to/file.py:function or package.module:function")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"rlcore_agent_{os.path.basename(where)[:-3]}", where)
        if spec is None or spec.loader is None:
            raise ValueError(f"{where!r} cannot be loaded as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{where} has no function {name!r}")
    return fn


def call_kwargs(fn, offered: dict) -> dict:
    """The arguments ``fn`` takes of those offered (all of them when it has ``**kwargs``)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(offered)
    return {k: v for k, v in offered.items() if k in params}


def as_reward(value):
    """What the agent returned as a reward: a number, None (the reward components score the final
    answer), or a dict with a "reward" entry."""
    if isinstance(value, dict):
        value = value.get("reward")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"the agent returned {type(value).__name__} {value!r:.80}; return a number, None or "
                        "{'reward': number}")
    return float(value)


def run_episode(fn, kwargs: dict) -> dict:
    """One episode in this process: the result line, never an exception."""
    try:
        if inspect.iscoroutinefunction(fn):
            import asyncio

            value = asyncio.run(fn(**kwargs))
        else:
            value = fn(**kwargs)
        return {"ok": True, "reward": as_reward(value), "error": None}
    except BaseException as e:  # noqa: BLE001 - the agent's failure is reported, whatever it is
        lines = traceback.format_exception(type(e), e, e.__traceback__)
        return {"ok": False, "reward": None, "error": "".join(lines)[-2000:]}


def _worker(fn, extra: dict, cmd_fd: int, out_fd: int) -> None:
    """A worker process: episodes one after another, each a JSON line in, its result a line out."""
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    commands = os.fdopen(cmd_fd, "rb")
    for line in commands:
        cmd = json.loads(line)
        result = run_episode(fn, call_kwargs(fn, {**cmd["call"], **extra}))
        data = (json.dumps({"id": cmd["id"], **result}, default=str) + "\n").encode()
        while data:
            data = data[os.write(out_fd, data):]
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)


class Zygote:
    """Worker processes forked from this one, each running one episode at a time and reused for the
    next: a fork and an exit cost about 4 ms of CPU for this process's 60 MB (page tables, and the
    pages a new process touches are copied), which an episode of a few requests would pay again."""

    def __init__(self, fn, extra: dict):
        self.fn, self.extra = fn, extra
        self.workers: dict[int, dict] = {}  # pid -> {"cmd", "out", "buf", "episode"}
        self.idle: list[int] = []
        self.running: dict[int, int] = {}  # episode id -> worker pid

    def emit(self, line: dict) -> None:
        sys.stdout.write(json.dumps(line, default=str) + "\n")
        sys.stdout.flush()

    def fork_worker(self) -> int:
        cmd_r, cmd_w = os.pipe()
        out_r, out_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(cmd_w)
                os.close(out_r)
                sys.stdin.close()
                for w in self.workers.values():  # the other workers' pipes are not this one's
                    os.close(w["cmd"])
                    os.close(w["out"])
                _worker(self.fn, self.extra, cmd_r, out_w)
            finally:
                os._exit(70)
        os.close(cmd_r)
        os.close(out_w)
        os.set_blocking(out_r, False)
        self.workers[pid] = {"cmd": cmd_w, "out": out_r, "buf": b"", "episode": None}
        return pid

    def start(self, eid: int, call: dict) -> None:
        pid = self.idle.pop() if self.idle else self.fork_worker()
        worker = self.workers[pid]
        worker["episode"], self.running[eid] = eid, pid
        data = (json.dumps({"id": eid, "call": call}, default=str) + "\n").encode()
        while data:
            data = data[os.write(worker["cmd"], data):]

    def kill(self, eid: int) -> None:
        """The episode's worker and everything it started (its session) die; reap() reports it."""
        pid = self.running.get(eid)
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def read_worker(self, pid: int) -> None:
        """The results the worker's pipe holds now: each ends its episode; the worker is idle again."""
        worker = self.workers[pid]
        while True:
            try:
                chunk = os.read(worker["out"], 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            worker["buf"] += chunk
        while b"\n" in worker["buf"]:
            line, worker["buf"] = worker["buf"].split(b"\n", 1)
            result = json.loads(line)
            if self.running.pop(result["id"], None) == pid:
                self.emit(result)
            worker["episode"] = None
            self.idle.append(pid)

    def reap(self) -> None:
        """Workers that died (killed at an episode's time limit, or their agent ended the process):
        the episode each was running ends with how."""
        for pid in list(self.workers):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done:
                continue
            self.read_worker(pid)
            worker = self.workers.pop(pid)
            os.close(worker["cmd"])
            os.close(worker["out"])
            self.idle = [p for p in self.idle if p != pid]
            eid = worker["episode"]
            if eid is not None and self.running.pop(eid, None) == pid:
                how = (f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                       else f"exited with code {os.WEXITSTATUS(status)}")
                self.emit({"id": eid, "ok": False, "reward": None, "error": f"{CRASHED} {how} before it returned"})

    def serve(self) -> None:
        stdin = sys.stdin.fileno()
        pending = b""
        while True:
            by_fd = {w["out"]: pid for pid, w in self.workers.items()}
            ready, _, _ = select.select([stdin, *by_fd], [], [], 0.02)
            for fd in ready:
                if fd != stdin:
                    self.read_worker(by_fd[fd])
                    continue
                chunk = os.read(stdin, 1 << 16)
                if not chunk:
                    return self.shutdown()
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    self.command(json.loads(line))
            self.reap()

    def command(self, cmd: dict) -> None:
        if cmd["op"] == "run":
            self.start(cmd["id"], cmd["call"])
        elif cmd["op"] == "kill":
            self.kill(cmd["id"])

    def shutdown(self) -> None:
        for pid in list(self.workers):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(0)


_CANNED = {"chat": {"id": "warm", "object": "chat.completion", "created": 0, "model": "warm",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop",
                                 "logprobs": None}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}},
           "text": {"id": "warm", "object": "text_completion", "created": 0, "model": "warm",
                    "choices": [{"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}}


def warm_openai() -> None:
    """One chat and one text completion through the openai client against a canned local server
    (nothing stays open); skipped where openai is not installed or the SDK refuses."""
    try:
        import openai
    except ImportError:
        return
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Canned(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = json.dumps(_CANNED["chat" if "chat" in self.path else "text"]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Canned)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="warm",
                           max_retries=0) as client:
            client.chat.completions.create(model="warm", messages=[{"role": "user", "content": "hi"}])
            client.completions.create(model="warm", prompt="hi")
    except Exception:  # noqa: BLE001 - a warm-up only
        pass
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def main() -> None:
    setup = json.loads(sys.stdin.readline())
    sys.path[:0] = setup.get("sys_path", [])
    try:
        for name in setup.get("preload", []):
            importlib.import_module(name)
        fn = load_entry(setup["entry"])
    except BaseException as e:  # noqa: BLE001 - reported to the trainer, which stops with it
        line = {"error": "".join(traceback.format_exception_only(type(e), e)).strip()[-2000:]}
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()
        return
    if "openai" in setup.get("preload", []):
        warm_openai()
    import gc

    gc.freeze()
    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    Zygote(fn, setup.get("kwargs", {})).serve()


if __name__ == "__main__":
    main()
