"""How the python tool's child is started under each local backend of :mod:`rlcore.agent.sandbox`.

Each builder returns a :class:`Launch` (argv, the fds to pass, cleanup) for ``python -I -S -c RUNNER``
in an empty working directory:

- ``bwrap``: bubblewrap makes new user, PID, mount, network, IPC and UTS namespaces; the child sees
  a read-only view of the interpreter's prefix and the system library dirs, its own /proc, a
  private /tmp and /dev, and the working directory (the only writable paths); uid 65534 inside.
- ``namespaces``: the same view built by the child itself with unshare(2), mount(2) and
  pivot_root(2) (:data:`NS_SETUP`), for hosts with unprivileged user namespaces but no bwrap.
- ``uid``: no namespaces: the child runs as an unprivileged uid of its own (one per concurrent call),
  and every process of that uid is killed after the call.
- ``process``: the plain child of earlier versions (its own session, rlimits, audit hook).

A root trainer maps namespaces children to a per-call uid too: the kernel exempts uid 0 from
RLIMIT_NPROC, so without it a fork bomb would only end at the timeout (bwrap can map the sandbox
only to the uid that runs it: under a root trainer its children keep uid 0 outside, without
capabilities, and RLIMIT_NPROC does not hold them).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field

NOBODY = 65534
SANDBOX_CWD = "/sandbox"  # the working directory's path inside bwrap / namespaces
# System dirs the interpreter may load shared libraries or run /bin/sh from (symlinks on merged-/usr
# systems are recreated as symlinks); only what exists is bound. /etc/ld.so.cache lets the loader
# find libraries in multiarch dirs.
SYSTEM_RO = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc/ld.so.cache", "/etc/localtime")


@dataclass
class Result:
    output: str  # stdout then stderr, cut to the byte limit
    error: str | None  # None: ran and exited 0; else "timeout" | "output_limit" | "exit N" | "signal N" | ...

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class Launch:
    argv: list[str]
    pass_fds: tuple[int, ...] = ()
    workdir: str = ""  # the call's working directory on the host (removed afterwards)
    base: str = ""  # the temporary directory holding it
    uid: int | None = None  # the per-call uid whose processes are killed afterwards
    close: list[int] = field(default_factory=list)  # fds to close once the child started
    group: object = None  # the call's control group (rlcore.agent.sandbox_cgroup.Group), or None
    oom_killed: bool = False  # the kernel's OOM killer ended a process of that group


# ------------------------------------------------------------------------------ the interpreter


@functools.lru_cache(maxsize=8)
def interpreter(python: str | None) -> tuple[str, tuple[str, ...]]:
    """(real path of the interpreter the child runs, its prefix dirs): the child runs ``-I -S``,
    so the base installation's stdlib is all it needs (not the venv)."""
    exe = os.path.realpath(python or sys.executable)
    if python is None or exe == os.path.realpath(sys.executable):
        prefixes = {sys.base_prefix, sys.base_exec_prefix}
    else:
        out = subprocess.run([exe, "-I", "-S", "-c", "import sys; print(sys.base_prefix); print(sys.base_exec_prefix)"],
                             capture_output=True, text=True, timeout=30)
        prefixes = set(out.stdout.split()) or {os.path.dirname(os.path.dirname(exe))}
    prefixes = {os.path.realpath(p) for p in prefixes}
    return exe, tuple(sorted(prefixes | {os.path.dirname(exe)}))


def read_only_view(python: str | None, extra: tuple[str, ...] = ()) -> list[tuple[str, str | None]]:
    """(path, symlink target or None) for everything the child sees read-only."""
    _, prefixes = interpreter(python)
    view, seen = [], set()
    for path in (*SYSTEM_RO, *prefixes, *extra):
        if path in seen or not os.path.lexists(path) or any(path.startswith(p + "/") for p in seen):
            continue
        seen.add(path)
        view.append((path, os.readlink(path) if os.path.islink(path) else None))
    return view


# ------------------------------------------------------------------------------ per-call uids

_SLOTS_LOCK = threading.Lock()
_SLOTS_BUSY: set[int] = set()
SLOTS_PER_PROCESS = 256  # concurrent calls of one process at most (rollout.multi_turn.tool_workers)
PID_SPAN = 2**22  # Linux's largest pid_max: each process of a host gets its own block of uids
UID_SPAN = PID_SPAN * SLOTS_PER_PROCESS  # uids above uid_base one host may use


def _process_base(base: int) -> int:
    """This process's block: the 8 or 16 ranks of a node (and test processes) each call tools, and
    one call's kill-everything-of-this-uid must never reach another process's call."""
    return base + (os.getpid() % PID_SPAN) * SLOTS_PER_PROCESS


def take_uid(base: int) -> int:
    """A uid no other running call holds (calls of a turn run side by side in the pool; other
    processes use other blocks), so that one call's kill-everything-of-this-uid never reaches
    another's processes."""
    with _SLOTS_LOCK:
        slot = next(i for i in range(len(_SLOTS_BUSY) + 1) if i not in _SLOTS_BUSY)
        if slot >= SLOTS_PER_PROCESS:
            raise RuntimeError(f"more than {SLOTS_PER_PROCESS} concurrent sandboxed calls in one process")
        _SLOTS_BUSY.add(slot)
    return _process_base(base) + slot


def give_uid(uid: int, base: int) -> None:
    with _SLOTS_LOCK:
        _SLOTS_BUSY.discard(uid - _process_base(base))


def kill_uid(uid: int, python: str | None) -> None:
    """SIGKILL every process of ``uid``: kill(-1) sent *as* that uid reaches exactly its processes,
    in one pass the kernel makes under its task list lock (a forking process cannot slip past)."""
    setpriv = shutil.which("setpriv")
    if setpriv:
        argv = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "/bin/sh", "-c", "kill -9 -1"]
    else:
        argv = [interpreter(python)[0], "-I", "-S", "-c",
                f"import os; os.setgroups([]); os.setgid({uid}); os.setuid({uid}); os.kill(-1, 9)"]
    try:
        subprocess.run(argv, capture_output=True, timeout=10, env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.TimeoutExpired):
        pass


# ------------------------------------------------------------------------------ builders


def bwrap_argv(runner: str, launch: Launch, python: str | None, extra: tuple[str, ...], flags: tuple[str, ...]) -> None:
    """bubblewrap's command line (bwrap runs as the trainer's uid: bwrap maps only that one)."""
    exe, _ = interpreter(python)
    argv = [shutil.which("bwrap") or "bwrap", "--unshare-user", "--uid", str(NOBODY),
            "--gid", str(NOBODY), "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session", *flags, "--hostname", "sandbox"]
    for path, link in read_only_view(python, extra):
        if link is not None:
            argv += ["--symlink", link, path]
        else:
            argv += ["--ro-bind", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--bind", launch.workdir, SANDBOX_CWD,
             "--chdir", SANDBOX_CWD, exe, "-I", "-S", "-c", runner]
    launch.argv = argv


# Runs in the child (``python -I -S``) before the runner: namespaces by syscalls, a tmpfs root with
# the read-only view bound in, pivot_root into it, then a second user namespace where the child is
# uid 65534 with no capabilities (the first one's root could otherwise remount the view writable),
# and exec of the runner. PID 1 of the new PID namespace is the runner: when it exits or is killed,
# the kernel kills every process left in the namespace. Its parent (this script, outside) relays
# the exit status and is what the trainer kills on a timeout; the runner dies with it (PDEATHSIG).
NS_SETUP = r'''
import ctypes, os, signal, sys
_c = __SETUP__
libc = ctypes.CDLL(None, use_errno=True)
def ok(r, what):
    if r != 0:
        e = ctypes.get_errno()
        sys.stderr.write(f"sandbox setup: {what}: {os.strerror(e)}\n")
        os._exit(125)
def write(path, text):
    with open(path, "w") as f:
        f.write(text)
def relay(pid):  # wait for the child, then end the same way it did
    _, st = os.waitpid(pid, 0)
    if os.WIFSIGNALED(st):  # SIGKILL/SIGSTOP take no handler (EINVAL): sent as they are
        if os.WTERMSIG(st) not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(os.WTERMSIG(st), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(st))
    os._exit(os.waitstatus_to_exitcode(st))
libc.prctl(1, 9)  # PR_SET_PDEATHSIG: SIGKILL when the trainer goes
NEW = 0x10000000 | 0x00020000 | 0x20000000 | 0x40000000 | 0x08000000 | 0x04000000  # user mnt pid net ipc uts
if _c["uid"] is None:  # map this uid to root inside; the sandbox runs as it
    uid, gid = os.geteuid(), os.getegid()
    ok(libc.unshare(NEW), "unshare")
    write("/proc/self/uid_map", f"0 {uid} 1"); write("/proc/self/setgroups", "deny"); write("/proc/self/gid_map", f"0 {gid} 1")
    inner = 0
else:  # a root trainer: inside, root stays root (to reach the view) and 1 is the call's own uid;
    # only a process left outside, still root, may write such a map
    r1, w1 = os.pipe(); r2, w2 = os.pipe()
    child = os.fork()
    if child:
        os.read(r1, 1)
        for name in ("uid_map", "gid_map"):
            write(f"/proc/{child}/{name}", f"0 0 1\n1 {_c['uid']} 1")
        os.write(w2, b"x")
        relay(child)
    libc.prctl(1, 9)
    ok(libc.unshare(NEW), "unshare")
    os.write(w1, b"x"); os.read(r2, 1)
    os.setgroups([])
    inner = 1
pid = os.fork()  # the first child in the new PID namespace is its PID 1
if pid:
    relay(pid)
libc.prctl(1, 9)
root = _c["root"]
m = libc.mount
ok(m(None, b"/", None, 0x4000 | 0x40000, None), "make / private")
ok(m(b"tmpfs", root.encode(), b"tmpfs", 2 | 4, b"mode=0755,size=4m"), "tmpfs root")
_FLAGS = ((2, 2), (4, 4), (8, 8), (1024, 1024), (2048, 2048), (4096, 1 << 21))  # statvfs -> mount flags
for src, dest, writable in _c["binds"]:
    target = root + dest
    if os.path.isdir(src):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True); open(target, "w").close()
    ok(m(src.encode(), target.encode(), None, 0x1000 | 0x4000, None), f"bind {src}")
    if not writable:  # a remount must keep the flags the kernel locked on the source mount
        keep = sum(mf for sf, mf in _FLAGS if os.statvfs(target).f_flag & sf)
        ok(m(None, target.encode(), None, 0x1000 | 0x20 | 1 | keep, None), f"read-only {src}")
for path, link in _c["links"]:
    os.makedirs(os.path.dirname(root + path), exist_ok=True); os.symlink(link, root + path)
for d in ("proc", "tmp", "dev"):
    os.makedirs(f"{root}/{d}", exist_ok=True)
m(b"proc", f"{root}/proc".encode(), b"proc", 2 | 4 | 8, None)  # may be refused in a container: then no /proc
ok(m(b"tmpfs", f"{root}/tmp".encode(), b"tmpfs", 2 | 4, b"mode=1777,size=64m"), "tmpfs /tmp")
for dev in ("null", "zero", "urandom", "random"):
    open(f"{root}/dev/{dev}", "w").close()
    m(f"/dev/{dev}".encode(), f"{root}/dev/{dev}".encode(), None, 0x1000, None)
os.chdir(root)
ok(libc.syscall(_c["pivot_root"], b".", b"."), "pivot_root")
ok(libc.umount2(b".", 2), "detach the old root")
os.chdir(_c["cwd"])
if inner:  # become the call's uid (this drops the capabilities of the first namespace)
    os.setresgid(inner, inner, inner); os.setresuid(inner, inner, inner)
    libc.prctl(4, 1); libc.prctl(1, 9)  # PR_SET_DUMPABLE (to map ourselves), PDEATHSIG: both reset by it
ok(libc.unshare(0x10000000), "second user namespace")
write("/proc/self/uid_map", f"65534 {inner} 1"); write("/proc/self/setgroups", "deny")
write("/proc/self/gid_map", f"65534 {inner} 1")
os.execve(_c["exe"], [_c["exe"], "-I", "-S", "-c", _c["runner"]], {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
'''

_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "riscv64": 41, "s390x": 217}


def namespaces_argv(runner: str, launch: Launch, python: str | None, extra: tuple[str, ...]) -> None:
    exe, _ = interpreter(python)
    view = read_only_view(python, extra)
    root = os.path.join(launch.base, "root")
    os.mkdir(root)
    setup = {"binds": [(p, p, False) for p, link in view if link is None] + [(launch.workdir, SANDBOX_CWD, True)],
             "links": [(p, link) for p, link in view if link is not None], "root": root, "uid": launch.uid,
             "cwd": SANDBOX_CWD, "exe": exe, "runner": runner, "pivot_root": _PIVOT_ROOT.get(os.uname().machine, 155)}
    launch.argv = [exe, "-I", "-S", "-c", NS_SETUP.replace("__SETUP__", repr(setup))]


def plain_argv(runner: str, launch: Launch, python: str | None) -> None:
    launch.argv = [interpreter(python)[0], "-I", "-S", "-c", runner]


def chown_for(launch: Launch) -> None:
    """Give the per-call uid the call's directories (its processes write the working directory)."""
    if launch.uid is not None:
        for path in (launch.workdir,):
            os.chown(path, launch.uid, launch.uid)


# ------------------------------------------------------------------------------ probes


@functools.lru_cache(maxsize=1)
def bwrap_flags() -> tuple[str, ...] | None:
    """Extra hardening this bwrap accepts (--disable-userns: 0.8+), or None when bwrap is absent."""
    exe = shutil.which("bwrap")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--unshare-user", "--disable-userns", "--ro-bind", "/", "/", "true"],
                             capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return ("--disable-userns",) if out.returncode == 0 else ()


def can_drop_uid() -> bool:
    """Whether this process may switch a child to another uid (root, or CAP_SETUID)."""
    return os.geteuid() == 0
