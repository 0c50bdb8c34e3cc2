"""The ``python`` tool's sandbox: model-written code runs in a child process that cannot hurt the run.

The boundary is the OS, the strongest backend available first (probed once; :func:`describe` says
which is in effect, and docs/tools.md has the table of threats against backends):

- ``bwrap`` (bubblewrap on PATH) and ``namespaces`` (unshare(2) with unprivileged user namespaces):
  new user, PID, mount, network, IPC and UTS namespaces; the child sees only a read-only view of the
  interpreter and the system library dirs, its own /proc, a private /tmp and its empty working
  directory; every process it starts dies with the call. See :mod:`rlcore.agent.sandbox_backends`.
- ``uid`` (a root trainer where namespaces are forbidden): an unprivileged uid per concurrent call,
  all of whose processes are killed after the call; the file system stays visible (weaker).
- ``process``: the plain child of earlier versions (weakest: same uid as the trainer unless it is
  root and nobody can read the interpreter).
- ``remote``: a SandboxFusion-style HTTP service of the user's (:mod:`rlcore.agent.sandbox_remote`).

Under every local backend the child also has: its own session, killed whole on the wall-clock
timeout or when its output passes the byte limit; rlimits (CPU seconds, address space, file size,
open files, processes); stdin closed, no inherited fds, an environment of PATH and LANG only; and an
audit hook inside the interpreter that refuses sockets, subprocesses, ctypes and writes outside the
working directory. The hook is there for clear error messages to honest code, not as the boundary:
C-level spawn paths (``_posixsubprocess.fork_exec``) raise no audit event.
"""

from __future__ import annotations

import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from rlcore.agent import sandbox_backends as sb, sandbox_cgroup as cg
from rlcore.agent.sandbox_backends import Result

LOCAL = ("bwrap", "namespaces", "uid", "process")
BACKENDS = ("auto", *LOCAL, "remote")
STRONG = ("bwrap", "namespaces", "remote")  # what strict: true accepts

# Runs in the child (``python -I -S``): limits first, then (uid / process backends) the network
# namespace and the uid drop, then the audit hook, then the model's code with its own globals. It is
# done here rather than in a preexec_fn, which is unsafe in the trainer's multi-threaded process.
# Python's audit events (docs.python.org/3/library/audit_events.html): open (path, mode, flags),
# socket.*, subprocess.Popen, os.fork/forkpty/posix_spawn/exec/system, ctypes.dlopen, os.remove/...
_RUNNER = r'''
import os, resource, sys
_cwd = os.getcwd()
_c = __CONFIG__
resource.setrlimit(resource.RLIMIT_CPU, (_c["cpu"], _c["cpu"] + 1))
resource.setrlimit(resource.RLIMIT_AS, (_c["mb"] * 2**20, _c["mb"] * 2**20))
resource.setrlimit(resource.RLIMIT_FSIZE, (_c["fsize"], _c["fsize"]))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if _c["netns"]:
    import ctypes
    # CLONE_NEWNET: only a down loopback from here on; without CAP_SYS_ADMIN, inside a new user
    # namespace (CLONE_NEWUSER), where unprivileged user namespaces are enabled
    if ctypes.CDLL(None).unshare(0x40000000) != 0:
        ctypes.CDLL(None).unshare(0x10000000 | 0x40000000)
    del ctypes
if _c["uid"] is not None:  # root ignores RLIMIT_NPROC and owns every file: become an unprivileged uid
    os.chown(_cwd, _c["uid"], _c["uid"])
    os.setgroups([])
    os.setgid(_c["uid"])
    os.setuid(_c["uid"])
resource.setrlimit(resource.RLIMIT_NPROC, (_c["procs"], _c["procs"]))
sys.path[:0] = _c["path"]
_DENY = ("socket.", "subprocess.", "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn",
         "os.system", "os.kill", "os.killpg", "ctypes.", "pty.", "os.setuid", "os.chown", "os.chmod")
_PATHS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.symlink", "os.link", "os.truncate")
def _inside(path):
    path = os.path.realpath(os.fspath(path))
    return path == _cwd or path.startswith(_cwd + os.sep)
def _hook(event, args):
    if event.startswith(_DENY):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event in _PATHS and args and isinstance(args[0], (str, bytes, os.PathLike)) and not _inside(args[0]):
        raise PermissionError(f"sandbox: {event} outside the working directory is not allowed")
    if event == "open" and args[0] is not None and not isinstance(args[0], int):
        mode, flags = args[1] or "r", args[2] or 0
        writes = any(c in mode for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        if writes and not _inside(args[0]):
            raise PermissionError(f"sandbox: writing {os.fspath(args[0])} is not allowed (only the working directory)")
sys.addaudithook(_hook)
del _hook
exec(compile(__CODE__, "<tool>", "exec"), {"__name__": "__main__"})
'''

_PROBE = "import json, decimal, fractions; print('ok')"  # imports after the uid drop: can it read the stdlib?


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    output_bytes: int = 16_384
    max_procs: int = 0  # further processes the child may start (RLIMIT_NPROC; not for uid 0)
    backend: str = "auto"  # one of BACKENDS (rollout.multi_turn.tools_sandbox.backend)
    strict: bool = False  # refuse to run under a backend outside STRONG
    python: str | None = None  # the interpreter the child runs (default: this one's base install)
    url: str | None = None  # the remote backend's service
    uid_base: int = 1_000_000_000  # per-call uids: uid_base + slot (root trainers)
    cgroup: str = "auto"  # a control group per call: auto (where one can be made) | off | required
    cpus: float | None = 1.0  # the call's CPU quota in its group (None: none)


class SandboxUnavailable(RuntimeError):
    """The configured backend cannot run here (the message says why and what to do)."""


# ------------------------------------------------------------------------------ probing


def _probe_env() -> dict:
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


@functools.lru_cache(maxsize=32)
def why_not(backend: str, python: str | None = None, uid_base: int = Limits.uid_base) -> str | None:
    """Why ``backend`` cannot run here, or None when a ``print`` went through it (probed once)."""
    if backend == "bwrap" and sb.bwrap_flags() is None:
        return "bwrap is not on PATH (install bubblewrap: apt-get install bubblewrap / dnf install bubblewrap)"
    if backend == "uid" and not sb.can_drop_uid():
        return f"needs a root trainer to switch uids (this one runs as uid {os.geteuid()})"
    if backend == "remote":
        return None
    result = _run_local(_PROBE, Limits(timeout_s=20, cpu_s=10, memory_mb=1024, backend=backend, python=python,
                                       uid_base=uid_base), backend)
    if result.ok and result.output.strip() == "ok":
        return None
    detail = result.output.strip().splitlines()[-1:] or [result.error or "no output"]
    hint = (f"; uid {uid_base} cannot read the interpreter {sb.interpreter(python)[0]} (a 0700 directory above it, "
            "e.g. /root?): set rollout.multi_turn.tools_sandbox.python to one every user can read (/usr/bin/python3)"
            if backend == "uid" else "")
    return f"a test call failed ({result.error}: {detail[0][:200]}){hint}"


def backend(limits: Limits = Limits()) -> str:
    """The backend calls under ``limits`` use: the configured one, or under auto the first that
    works here of bwrap, namespaces, uid, process."""
    if limits.backend != "auto":
        return limits.backend
    return next(b for b in LOCAL if b == "process" or why_not(b, limits.python, limits.uid_base) is None)


def check(limits: Limits) -> None:
    """Raise :class:`SandboxUnavailable` when the configured backend cannot run here, or strict
    refuses the one auto found."""
    chosen = backend(limits)
    if chosen not in ("auto", "process") and (why := why_not(chosen, limits.python, limits.uid_base)):
        raise SandboxUnavailable(f"backend={chosen!r} cannot run on this host: {why}; use backend: auto (the "
                                 "strongest available) or fix the host")
    if limits.strict and chosen not in STRONG:
        raise SandboxUnavailable(
            f"strict: true refuses the {chosen!r} backend, the strongest this host allows ("
            + "; ".join(f"{b}: {why_not(b, limits.python, limits.uid_base)}" for b in ("bwrap", "namespaces"))
            + "); install bubblewrap or allow unprivileged user namespaces, point backend: remote at a sandbox "
            "service, or set strict: false to accept it")
    if limits.cgroup == "required" and chosen != "remote" and cg.probe()[0] is None:
        raise SandboxUnavailable(f"cgroup: required, but no control group can be made per call here "
                                 f"({cg.probe()[1]}); run the trainer where its cgroup delegates memory/pids/cpu "
                                 "(systemd Delegate=yes, Slurm's cgroup/v2), or set cgroup: auto")


def isolation(limits: Limits = Limits()) -> dict[str, bool]:
    """Which layers are in effect for calls under ``limits`` on this host (printed at start-up)."""
    chosen = backend(limits)
    ns = chosen in ("bwrap", "namespaces")
    legacy = _legacy_layers(limits.python) if chosen == "process" else {}
    return {"user_pid_mount_namespaces": ns, "network_namespace": ns or chosen == "remote" or
            legacy.get("network_namespace", chosen == "uid" and _netns_ok(limits.python)),
            "read_only_file_system_view": ns,
            "every_descendant_killed": ns or chosen == "uid" or _cgroup_place(limits, chosen) is not None,
            "unprivileged_uid": chosen in ("uid", "remote") or ns or legacy.get("unprivileged_uid", False),
            "nproc_limit": os.geteuid() != 0 or legacy.get("unprivileged_uid", False) or _per_call_uid(chosen),
            "rlimits": chosen != "remote", "own_session": chosen != "remote", "audit_hook": chosen != "remote",
            "cgroup_limits": _cgroup_place(limits, chosen) is not None}


def _cgroup_place(limits: Limits, chosen: str) -> cg.Place | None:
    return None if limits.cgroup == "off" or chosen == "remote" else cg.probe()[0]


def describe(limits: Limits = Limits()) -> str:
    chosen = backend(limits)
    layers = isolation(limits)
    on = [k for k, v in layers.items() if v]
    off = [k for k, v in layers.items() if not v]
    skipped = [f"{b}: {why_not(b, limits.python, limits.uid_base)}" for b in LOCAL[: LOCAL.index(chosen)]] \
        if limits.backend == "auto" and chosen in LOCAL else []
    weak = (" WEAKER MODE: the file system is visible to the child and its processes share the host's PID space"
            if chosen in ("uid", "process") else "")
    where = f" at {limits.url}" if chosen == "remote" else ""
    return (f"python tool sandbox: backend {chosen}{where}" + (f" (skipped {'; '.join(skipped)})" if skipped else "")
            + f";{weak} layers: {', '.join(on)}" + (f" (not in effect: {', '.join(off)})" if off else "")
            + f"; limits {limits.timeout_s:g} s wall, {limits.cpu_s} s CPU, {limits.memory_mb} MiB, "
            f"{limits.output_bytes} B output; {_cgroup_note(limits, chosen)}. See docs/tools.md")


def _cgroup_note(limits: Limits, chosen: str) -> str:
    if limits.cgroup == "off" or chosen == "remote":
        return "no control group per call (cgroup: off)" if chosen != "remote" else "limits: the service's"
    place, why = cg.probe()
    if place is None:
        return f"no control group per call ({why}): the rlimits bound each process alone"
    cpu = f", {limits.cpus:g} CPU" if limits.cpus is not None and "cpu" in place.controllers else ""
    return (f"a control group per call: {why}; {limits.memory_mb} MiB, {limits.max_procs + cg.OWN_PROCS} "
            f"processes{cpu} for the whole call, every process killed at its end")


@functools.lru_cache(maxsize=8)
def _netns_ok(python: str | None) -> bool:
    return _probe_ok(python, "import ctypes, sys; u = ctypes.CDLL(None).unshare; "
                             "sys.exit(u(0x40000000) != 0 and u(0x50000000) != 0)")


@functools.lru_cache(maxsize=8)
def _legacy_layers(python: str | None) -> dict[str, bool]:
    """The process backend's layers (as in earlier versions): a network namespace where unshare(2)
    is allowed; nobody for a root trainer only if nobody can still import the standard library."""
    nobody = os.geteuid() == 0 and _probe_ok(
        python, "import os; os.setgroups([]); os.setgid(65534); os.setuid(65534); import json, decimal, fractions")
    return {"network_namespace": _netns_ok(python), "unprivileged_uid": nobody}


def _per_call_uid(chosen: str) -> bool:
    """Whether calls run as a uid of their own: a root trainer's namespaces and uid backends."""
    return sb.can_drop_uid() and chosen in ("namespaces", "uid")


def _probe_ok(python: str | None, code: str) -> bool:
    try:
        return subprocess.run([sb.interpreter(python)[0], "-I", "-S", "-c", code], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# ------------------------------------------------------------------------------ running


def run_python(code: str, limits: Limits = Limits(), extra_paths: tuple[str, ...] = ()) -> Result:
    """Run ``code`` in a fresh sandboxed interpreter; never raises for anything the code does.
    ``extra_paths``: dirs the child may read and import from (a sandboxed user tool's site-packages)."""
    chosen = backend(limits)
    if limits.strict and chosen not in STRONG:
        return Result("", f"sandbox refused: strict: true and the {chosen!r} backend")
    if chosen == "remote":
        from rlcore.agent import sandbox_remote

        return sandbox_remote.run(code, limits)
    return _run_local(code, limits, chosen, extra_paths)


def _runner(code: str, limits: Limits, chosen: str, extra_paths: tuple[str, ...], uid: int | None) -> str:
    legacy = _legacy_layers(limits.python) if chosen == "process" else {}
    config = {"mb": limits.memory_mb, "cpu": limits.cpu_s, "fsize": limits.output_bytes * 64,
              "procs": limits.max_procs + 1, "path": list(extra_paths),
              "netns": legacy.get("network_namespace", False) or (chosen == "uid" and _netns_ok(limits.python)),
              "uid": uid if chosen == "uid" else (sb.NOBODY if legacy.get("unprivileged_uid") else None)}
    return _RUNNER.replace("__CONFIG__", repr(config)).replace("__CODE__", repr(code))


def _launch(code: str, limits: Limits, chosen: str, extra_paths: tuple[str, ...]) -> sb.Launch:
    base = tempfile.mkdtemp(prefix="rl_tool_")
    launch = sb.Launch([], workdir=os.path.join(base, "work"), base=base)
    os.mkdir(launch.workdir)
    if _per_call_uid(chosen):  # uid 0 is exempt from RLIMIT_NPROC: a uid per call
        launch.uid = sb.take_uid(limits.uid_base)
    runner = _runner(code, limits, chosen, extra_paths, launch.uid)
    if chosen == "bwrap":
        sb.bwrap_argv(runner, launch, limits.python, extra_paths, sb.bwrap_flags() or ())
    elif chosen == "namespaces":
        sb.namespaces_argv(runner, launch, limits.python, extra_paths)
    else:
        sb.plain_argv(runner, launch, limits.python)
    if chosen in ("bwrap", "namespaces", "uid"):
        sb.chown_for(launch)
    return launch


def _run_local(code: str, limits: Limits, chosen: str, extra_paths: tuple[str, ...] = ()) -> Result:
    try:
        launch = _launch(code, limits, chosen, extra_paths)
    except OSError as e:
        return Result("", f"start failed: {e}")
    if (place := _cgroup_place(limits, chosen)) is not None:
        try:
            launch.group = cg.create(place, memory_mb=limits.memory_mb, procs=limits.max_procs + cg.OWN_PROCS,
                                     cpus=limits.cpus)
        except OSError as e:
            _cleanup(None, launch, limits)
            return Result("", f"start failed: no control group for the call: {e}")
        launch.argv = cg.join_argv(launch.group, launch.argv)
    elif limits.cgroup == "required":
        _cleanup(None, launch, limits)
        return Result("", "sandbox refused: cgroup: required and no control group can be made here")
    try:
        proc = subprocess.Popen(
            launch.argv, cwd=launch.workdir, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, close_fds=True,
            pass_fds=launch.pass_fds, start_new_session=True)
    except OSError as e:  # could not even start (e.g. the host is out of processes)
        _cleanup(None, launch, limits)
        return Result("", f"start failed: {e}")
    for fd in launch.close:
        os.close(fd)
    launch.close = []
    try:
        out, error = _collect(proc, limits)
    finally:
        _cleanup(proc, launch, limits)
    text = out.decode("utf-8", errors="replace")
    if error is None and proc.returncode:
        code_ = proc.returncode
        error = f"signal {-code_}" if code_ < 0 else f"exit {code_}"
        if launch.group is not None and code_ == cg.JOIN_FAILED and not out:
            error = "start failed: the child could not join its control group"
    if launch.oom_killed and error != "timeout":
        error = "memory_limit"  # the kernel's OOM killer, in the call's group
    return Result(text, error)


def _cleanup(proc: subprocess.Popen | None, launch: sb.Launch, limits: Limits) -> None:
    """Kill what is left of the call (its session; under the uid backend every process of its uid),
    give its uid back, remove its directories."""
    if proc is not None:
        _kill_group(proc)
    if launch.group is not None:  # every process of the call, whatever session or uid it took
        launch.oom_killed = cg.memory_killed(launch.group)
        cg.destroy(launch.group)
    for fd in launch.close:
        os.close(fd)
    if launch.uid is not None:
        sb.kill_uid(launch.uid, limits.python)
        sb.give_uid(launch.uid, limits.uid_base)
    shutil.rmtree(launch.base, ignore_errors=True)


def _collect(proc: subprocess.Popen, limits: Limits) -> tuple[bytes, str | None]:
    """Read the child's output until it exits, the wall clock runs out, or the output is too long."""
    deadline, chunks, size = time.monotonic() + limits.timeout_s, [], 0
    fd = proc.stdout.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"".join(chunks), "timeout"
        ready, _, _ = select.select([fd], [], [], min(left, 0.5))
        if ready:
            data = os.read(fd, 65536)
            if not data:  # EOF: the child closed its output (exited, or closed it and lingers)
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    return b"".join(chunks), "timeout"
                return b"".join(chunks), None
            chunks.append(data)
            size += len(data)
            if size > limits.output_bytes:
                return b"".join(chunks)[: limits.output_bytes], "output_limit"


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the child's whole session (it may have left descendants) and reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover (a zombie that would not die)
        pass
    proc.stdout.close()


# ------------------------------------------------------------------------------ sandboxed user tools

RESULT_MARK = "\x1eRLCORE_TOOL_RESULT "


def function_code(path: str, fn_name: str, arguments: dict) -> str:
    """The child's program for a sandboxed user tool: the tool file's source runs as a module, the
    function is called with the JSON arguments, and its result comes back as one JSON line."""
    with open(path) as f:
        source = f.read()
    return (f"import json, sys, types\nmod = types.ModuleType({os.path.splitext(os.path.basename(path))[0]!r})\n"
            f"mod.__file__ = {path!r}\nsys.modules[mod.__name__] = mod\n"
            f"exec(compile({source!r}, {path!r}, 'exec'), mod.__dict__)\n"
            f"value = getattr(mod, {fn_name!r})(**json.loads({json.dumps(arguments)!r}))\n"
            f"print({RESULT_MARK!r} + json.dumps(value, default=str))\n")


def site_packages() -> tuple[str, ...]:
    """The venv's site-packages dirs: what a sandboxed user tool may import third-party code from."""
    return tuple(p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p))


def run_function(path: str, fn_name: str, arguments: dict, limits: Limits) -> tuple[object, Result]:
    """Call ``fn_name`` of the tool file ``path`` in the sandbox: (its JSON-decoded result or None, the run)."""
    result = run_python(function_code(path, fn_name, arguments), limits, site_packages())
    head, mark, tail = result.output.rpartition(RESULT_MARK)
    if not result.ok or not mark:
        return None, result
    try:
        return json.loads(tail), Result(head, None)
    except ValueError:
        return None, Result(result.output, "bad_result")
