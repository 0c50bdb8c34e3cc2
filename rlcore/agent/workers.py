"""Where the user's agent code runs: one process per episode (``rollout.agent.workers: process``, the
default) or a thread of the trainer (``thread``).

process: a zygote (rlcore/agent/zygote.py) is started once per rank as a fresh interpreter, not
forked from the trainer (a fork of a process holding a vLLM engine, torch's thread pools and gloo's
sockets inherits their locks mid-state). It imports the agent's module once and forks a child per
episode: a few milliseconds, and the child can be killed. An episode past its time limit has its
process group killed; an agent that crashes the interpreter (a segfault, ``os._exit``, the OOM
killer) ends only its episode. The children use the CPU the trainer's threads do not hold.

thread: the agent runs in a thread pool inside the trainer, sharing its interpreter (and GIL). An
episode past its time limit is ended (its key revoked, so its next request fails) but its thread
cannot be killed: it runs on until the agent returns. For agents that are known to end, and for
debugging (a breakpoint works).

Both report ``(episode id, ok, reward, error)`` through ``events()`` and wake the serving loop.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

_ZYGOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote.py")
_PRELOAD = ("openai",)  # what most agents import: loaded once in the zygote, shared by every fork
_SETUP_TIMEOUT_S = 120.0


class AgentLoadError(RuntimeError):
    """The agent's module does not import (a user error: the trainer stops with exit code 2)."""


class _Events:
    def __init__(self, wake: threading.Event):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = wake

    def put(self, eid: int, ok: bool, reward, error) -> None:
        self.queue.put((eid, ok, reward, error))
        self.wake.set()

    def drain(self) -> list[tuple]:
        out = []
        while True:
            try:
                out.append(self.queue.get_nowait())
            except queue.Empty:
                return out


class ProcessRunner:
    """A zygote per rank; ``start`` forks an episode's process, ``kill`` ends it."""

    def __init__(self, entry: str, kwargs: dict, wake: threading.Event):
        self.entry, self.events_ = entry, _Events(wake)
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD",)}  # vLLM's allocator preload
        self.proc = subprocess.Popen([sys.executable, "-u", _ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, cwd=os.getcwd(), text=True, bufsize=1, start_new_session=True)
        preload = [m for m in _PRELOAD if _importable(m)]
        self._send({"entry": entry, "sys_path": [os.getcwd()], "preload": preload, "kwargs": kwargs})
        answer = self._first_line()
        if "error" in answer:
            self.close()
            raise AgentLoadError(f"rollout.agent.entry={entry!r} does not load: {answer['error']}")
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, name="rl-agent-zygote", daemon=True)
        self.reader.start()

    def _first_line(self) -> dict:
        box: list = []
        t = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(_SETUP_TIMEOUT_S)
        if not box or not box[0]:
            self.close()
            raise AgentLoadError(f"rollout.agent.entry={self.entry!r}: the agent's worker process did not start "
                                 f"(no answer in {_SETUP_TIMEOUT_S:g} s; exit code {self.proc.poll()})")
        return json.loads(box[0])

    def _send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj, default=str) + "\n")
        self.proc.stdin.flush()

    def _read(self) -> None:
        for line in self.proc.stdout:
            r = json.loads(line)
            self.events_.put(r["id"], r["ok"], r.get("reward"), r.get("error"))

    def start(self, eid: int, call: dict) -> None:
        with self.lock:
            self._send({"op": "run", "id": eid, "call": call})

    def kill(self, eid: int) -> None:
        with self.lock:
            self._send({"op": "kill", "id": eid})

    def events(self) -> list[tuple]:
        if self.proc.poll() is not None and self.events_.queue.empty():
            raise RuntimeError(f"the agents' zygote process exited with code {self.proc.returncode}")
        return self.events_.drain()

    def close(self) -> None:
        """Every episode process goes with the zygote (it kills its children when its stdin ends)."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


class ThreadRunner:
    """The agent in the trainer's own threads (see the module docstring: a hung one cannot be killed)."""

    def __init__(self, entry: str, kwargs: dict, wake: threading.Event, workers: int = 256):
        from rlcore.agent import zygote

        try:
            self.fn = zygote.load_entry(entry)
        except Exception as e:
            raise AgentLoadError(f"rollout.agent.entry={entry!r} does not load: {type(e).__name__}: {e}") from e
        self.kwargs, self.events_ = kwargs, _Events(wake)
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rl-agent")
        self.zygote = zygote

    def start(self, eid: int, call: dict) -> None:
        def run():
            r = self.zygote.run_episode(self.fn, self.zygote.call_kwargs(self.fn, {**call, **self.kwargs}))
            self.events_.put(eid, r["ok"], r["reward"], r["error"])

        self.pool.submit(run)

    def kill(self, eid: int) -> None:
        pass  # a thread cannot be killed: the episode's key is revoked instead (serve.py)

    def events(self) -> list[tuple]:
        return self.events_.drain()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def make_runner(kind: str, entry: str, kwargs: dict, wake: threading.Event):
    """``rollout.agent.workers`` -> its runner (process | thread)."""
    runners = {"process": ProcessRunner, "thread": ThreadRunner}
    if kind not in runners:
        raise ValueError(f"rollout.agent.workers={kind!r}: choose one of {', '.join(runners)}")
    return runners[kind](entry, kwargs, wake)
