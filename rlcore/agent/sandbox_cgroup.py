"""A control group per python-tool call: the kernel bounds memory, processes and CPU for the whole
call (every process it starts, in any session, under any uid), and every process of the call is
killed at its end. The rlimits of :mod:`rlcore.agent.sandbox` bound each process alone: a root
child is exempt from RLIMIT_NPROC, and N forked children may each use ``memory_mb``.

Where a group can be made (probed once, with a real child moved into a real group):

- cgroup v2 (the unified hierarchy): a child of this process's group when its
  ``cgroup.subtree_control`` already enables the controllers (a delegated subtree: systemd's
  ``Delegate=yes``, the root group), else a sibling under its parent when the parent's does and
  it is writable (Slurm's cgroup/v2 puts tasks in ``step_N/user/task_M`` with controllers enabled
  in ``user``, owned by root: a root trainer there). A group with member processes may not
  enable controllers for children (the kernel's "no internal processes" rule,
  Documentation/admin-guide/cgroup-v2.rst), so the trainer never enables them itself.
- cgroup v1: a child of this process's group in each of the memory, pids and cpu hierarchies
  that this process may write (root in a container on a v1 host, as on this project's machines).
- otherwise none: the rlimits stay the only bounds, and the start-up line says so.

The child joins before it runs anything: the command starts as ``/bin/sh -c 'echo $$ >
.../cgroup.procs ... exec "$@"'`` (no ``preexec_fn`` in a threaded trainer), so a process it
forks is born inside the group.
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

CONTROLLERS = ("memory", "pids", "cpu")
PERIOD_US = 100_000  # cpu.max / cpu.cfs_period_us: the quota is cpus x this, per period
# Processes of the sandbox's own around the code: the joining shell (exec'd away), bwrap's monitor
# and its pid 1, unshare, the interpreter; a pids cap of max_procs + this leaves them room.
OWN_PROCS = 6
JOIN_FAILED = 97  # the joining shell's exit code when the group refuses the child
_counter = itertools.count()
_lock = threading.Lock()


@dataclass(frozen=True)
class Place:
    """Where this process makes its calls' groups: (controller, parent dir) per controller."""

    version: int  # 1 or 2
    parents: tuple[tuple[str, str], ...]  # v2: one dir for all; v1: one per hierarchy

    @property
    def controllers(self) -> list[str]:
        return [c for c, _ in self.parents]


@dataclass
class Group:
    place: Place
    dirs: list[str] = field(default_factory=list)  # one per distinct parent (v2: one)

    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount root inside the hierarchy, mount point, fstype, options) of every cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            a, b = left.split(), right.split()
            if b and b[0] in ("cgroup", "cgroup2"):
                out.append((a[3], a[4], b[0], set(b[2].split(",")) if len(b) > 2 else set()))
    return out


def _own_paths() -> dict[str, str]:
    """Controller (or "" for v2) -> this process's path in that hierarchy (/proc/self/cgroup)."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            for c in (ctrls.split(",") if ctrls else [""]):
                out[c] = path
    return out


def _dir(mount_root: str, mount_point: str, path: str) -> str:
    rel = os.path.relpath(path, mount_root) if path.startswith(mount_root) else path.lstrip("/")
    return os.path.normpath(os.path.join(mount_point, "" if rel == "." else rel))


def _enabled(d: str) -> set[str]:
    try:
        with open(os.path.join(d, "cgroup.subtree_control")) as f:
            return set(f.read().split())
    except OSError:
        return set()


def _candidates(mounts=None, own=None, enabled=_enabled, writable=lambda d: os.access(d, os.W_OK)) -> list[Place]:
    """Places to try, v2 first: the own group, then its parent (v2); the own group per controller
    (v1). ``mounts``/``own``/``enabled``/``writable``: this process's, unless given (tests)."""
    mounts = _mounts() if mounts is None else mounts
    own = _own_paths() if own is None else own
    places = []
    v2 = next((m for m in mounts if m[2] == "cgroup2"), None)
    if v2 is not None and "" in own:
        mine = _dir(v2[0], v2[1], own[""])
        for d in (mine, os.path.dirname(mine)):
            have = [c for c in CONTROLLERS if c in enabled(d)]
            if have and d.startswith(v2[1]) and writable(d):
                places.append(Place(2, tuple((c, d) for c in have)))
    v1 = []
    for c in CONTROLLERS:
        m = next((m for m in mounts if m[2] == "cgroup" and c in m[3]), None)
        if m is not None and c in own:
            d = _dir(m[0], m[1], own[c])
            if writable(d):
                v1.append((c, d))
    if v1:
        places.append(Place(1, tuple(v1)))
    return places


@functools.lru_cache(maxsize=1)
def probe() -> tuple[Place | None, str]:
    """(where calls get their groups, or None; why, in words). A place counts only once a real
    child was moved into a real group there and the limit files were written."""
    try:
        candidates = _candidates()
    except (OSError, ValueError, IndexError) as e:
        return None, f"cgroups not readable ({type(e).__name__}: {e})"
    if not candidates:
        return None, ("no writable group with memory/pids/cpu controllers for this process (cgroup v2: none "
                      "delegated to its group or its parent; cgroup v1: no writable hierarchy)")
    problems = []
    for place in candidates:
        group = None
        try:
            group = create(place, memory_mb=256, procs=OWN_PROCS, cpus=1.0)
            rc = subprocess.run(join_argv(group, ["/bin/true"]), timeout=30).returncode
            if rc != 0:
                raise OSError(f"a child could not join (exit {rc})")
            return place, (f"cgroup v{place.version} {', '.join(place.controllers)} per call "
                           f"(under {', '.join(sorted({d for _, d in place.parents}))})")
        except (OSError, subprocess.SubprocessError) as e:
            problems.append(f"v{place.version}: {e}")
        finally:
            if group is not None:
                destroy(group)
    return None, "; ".join(problems)


def _write(d: str, name: str, value: str, required: bool = True) -> None:
    try:
        with open(os.path.join(d, name), "w") as f:
            f.write(value)
    except OSError:
        if required:
            raise


def create(place: Place, *, memory_mb: int, procs: int, cpus: float | None) -> Group:
    """A new group for one call, its limits written: memory (swap included where the kernel
    counts it), process count (threads included), CPU quota (``cpus`` per period; None: none)."""
    with _lock:
        name = f"rlcore-tool-{os.getpid()}-{next(_counter)}"
    group = Group(place)
    quota = None if cpus is None else max(int(cpus * PERIOD_US), 1000)
    try:
        for parent in dict.fromkeys(d for _, d in place.parents):
            d = os.path.join(parent, name)
            os.mkdir(d)
            group.dirs.append(d)
        for c, parent in place.parents:
            d = os.path.join(parent, name)
            if c == "memory":
                _limit_memory(d, place.version, memory_mb * 2**20)
            elif c == "pids":
                _write(d, "pids.max", str(procs))
            elif c == "cpu" and quota is not None:
                if place.version == 2:
                    _write(d, "cpu.max", f"{quota} {PERIOD_US}")
                else:
                    _write(d, "cpu.cfs_period_us", str(PERIOD_US))
                    _write(d, "cpu.cfs_quota_us", str(quota))
    except OSError:
        destroy(group)
        raise
    return group


def _limit_memory(d: str, version: int, nbytes: int) -> None:
    if version == 2:
        _write(d, "memory.max", str(nbytes))
        _write(d, "memory.swap.max", "0", required=False)
    else:
        _write(d, "memory.limit_in_bytes", str(nbytes))
        _write(d, "memory.memsw.limit_in_bytes", str(nbytes), required=False)  # after the plain limit


def join_argv(group: Group, argv: list[str]) -> list[str]:
    """``argv`` started by a shell that first moves itself into every directory of ``group``."""
    moves = " && ".join(f"echo $$ > '{p}'" for p in group.procs_files())
    return ["/bin/sh", "-c", f'{moves} || exit {JOIN_FAILED}; exec "$@"', "sh", *argv]


def _members(group: Group) -> set[int]:
    pids = set()
    for p in group.procs_files():
        try:
            with open(p) as f:
                pids.update(int(x) for x in f.read().split())
        except OSError:
            pass
    return pids


def memory_killed(group: Group) -> bool:
    """Whether the kernel's OOM killer ended a process of the group (its memory limit)."""
    for c, parent in group.place.parents:
        if c != "memory":
            continue
        d = os.path.join(parent, os.path.basename(group.dirs[0]))
        name = "memory.events" if group.place.version == 2 else "memory.oom_control"
        try:
            with open(os.path.join(d, name)) as f:
                fields = dict(line.split() for line in f if len(line.split()) == 2)
        except OSError:
            return False
        return int(fields.get("oom_kill", 0)) > 0
    return False


def destroy(group: Group, wait_s: float = 5.0) -> int:
    """Kill every process of the group (whatever session or uid it took), then remove it.
    Returns how many were still alive."""
    killed = 0
    deadline = time.monotonic() + wait_s
    for d in group.dirs:
        _write(d, "cgroup.kill", "1", required=False)  # v2 (Linux 5.14+): the kernel kills them all
    while (pids := _members(group)) and time.monotonic() < deadline:
        for pid in pids:  # v1, or a v2 kernel without cgroup.kill: a fork bomb is bounded by pids.max
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)
    for d in reversed(group.dirs):
        while True:
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError:  # EBUSY while the last of them are reaped
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
    return killed
