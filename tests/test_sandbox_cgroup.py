"""A control group per python-tool call (rlcore/agent/sandbox_cgroup.py), on the real kernel: code
that reaches the OS past the audit hook (tests/workers/sandbox_trainer.py's C-level spawn) forks
past the rlimits (root is exempt from RLIMIT_NPROC; each child has its own address-space limit) and
escapes the session kill; the group bounds and ends all of it. Runs where this machine lets the
trainer make a group (root on a cgroup v1 host, or a delegated cgroup v2 subtree), else skipped
with the probe's reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "tests", "workers"))
from sandbox_trainer import SPAWN  # noqa: E402

BACKENDS = ["bwrap", "uid", "process"]


def _place():
    from rlcore.agent import sandbox_cgroup as cg

    place, why = cg.probe()
    if place is None:
        pytest.skip(f"no control group can be made per call on this machine: {why}")
    return place


def _limits(backend: str, **kw):
    from rlcore.agent.sandbox import Limits, why_not

    python = "/usr/bin/python3" if backend == "uid" and os.geteuid() == 0 else None
    if backend != "process" and (why := why_not(backend, python)):
        pytest.skip(f"backend {backend} is not available on this machine: {why}")
    return Limits(backend=backend, python=python, **{"timeout_s": 10.0, "cpu_s": 10, "memory_mb": 256, **kw})


def _alive(token: str, settle_s: float = 5.0) -> list[str]:
    """The processes whose command line holds ``token``, once the kills sent have landed: SIGKILL
    to 60 processes is asynchronous, and on a loaded machine a few are still listed a moment after
    the call returned (seen once with the whole suite running beside it). A process that outlives
    ``settle_s`` really got out."""
    deadline = time.monotonic() + settle_s
    while True:
        out = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout
        alive = [ln for ln in out.splitlines()
                 if token in ln and "ps -eo" not in ln and ln.split()[1][:1] != "Z"]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _groups_left(place) -> list[str]:
    return [n for _, d in place.parents for n in os.listdir(d) if n.startswith(f"rlcore-tool-{os.getpid()}-")]


def _fork_bomb(token: str, setsid: bool = True) -> str:
    return SPAWN + (f"n = 0\nfor i in range(60):\n    try:\n        spawn(['/bin/sleep', '30.{token}'], setsid={setsid})\n"
                    "    except OSError as e:\n        print('refused', type(e).__name__)\n        break\n"
                    "    n += 1\nprint('spawned', n)\n")


@pytest.mark.unit
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fork_bomb_is_bounded_and_ended_with_the_call(backend):
    """Processes started past the audit hook, each in its own session: the group's pids cap stops
    them at max_procs + the sandbox's own, and the call's end kills every one."""
    from rlcore.agent import sandbox_cgroup as cg
    from rlcore.agent.sandbox import run_python

    place = _place()
    if "pids" not in place.controllers:
        pytest.skip(f"this machine's groups have no pids controller ({place.controllers})")
    token = uuid.uuid4().hex[:8]
    result = run_python(_fork_bomb(token), _limits(backend))
    assert "refused" in result.output, result
    spawned = int(result.output.split("spawned")[-1].split()[0])
    assert spawned < cg.OWN_PROCS, result  # none of the 60 would have been refused under root otherwise
    assert not _alive(token), _alive(token)  # setsid'd, yet gone: the group was emptied
    assert not _groups_left(place)


@pytest.mark.unit
def test_without_a_group_the_same_bomb_gets_out_as_root():
    """The control: cgroup off, a root trainer's child forks all 60 (RLIMIT_NPROC does not apply
    to uid 0), in the call's own session here so that the session kill still ends them."""
    from rlcore.agent.sandbox import run_python

    _place()
    if os.geteuid() != 0:
        pytest.skip("RLIMIT_NPROC holds for a non-root trainer: the control needs root")
    token = uuid.uuid4().hex[:8]
    result = run_python(_fork_bomb(token, setsid=False), _limits("process", cgroup="off"))
    assert "spawned 60" in result.output, result
    assert not _alive(token)


@pytest.mark.parametrize("backend", BACKENDS)
def test_children_together_cannot_pass_the_calls_memory(backend):
    """Four fresh interpreters of 150 MiB each (each under its own 256 MiB address-space rlimit):
    600 MiB together, past the call's 256 MiB group; the kernel's OOM killer ends them."""
    from rlcore.agent.sandbox import run_python

    if "memory" not in _place().controllers:
        pytest.skip("this machine's groups have no memory controller")
    grow = ("import time; b = bytearray(150 << 20)\\nfor i in range(0, len(b), 4096): b[i] = 1\\n"
            "time.sleep(3)")
    code = SPAWN + ("import sys\npids = [spawn([sys.executable, '-I', '-S', '-c', " + repr(grow.replace("\\n", "\n"))
                    + "], setsid=False) for _ in range(4)]\nprint([wait(p) for p in pids])\n")
    result = run_python(code, _limits(backend, memory_mb=256, max_procs=8))
    assert result.error == "memory_limit", result


@pytest.mark.parametrize("backend", ["bwrap", "process"])
def test_the_calls_cpu_quota(backend):
    """cpus: 0.2 -> a busy loop of 1.5 s wall gets about 0.3 s of CPU (unbounded: about 1.5)."""
    from rlcore.agent.sandbox import run_python

    if "cpu" not in _place().controllers:
        pytest.skip("this machine's groups have no cpu controller")
    code = ("import time\nt0, w0 = time.process_time(), time.time()\nwhile time.time() - w0 < 1.5:\n    pass\n"
            "print(round(time.process_time() - t0, 3))")
    result = run_python(code, _limits(backend, cpus=0.2))
    assert result.ok and float(result.output) < 0.6, result


@pytest.mark.unit
def test_the_start_up_line_and_the_config_say_so(monkeypatch):
    from rlcore.agent import sandbox_cgroup as cg
    from rlcore.agent.config import ToolsSandboxConfig
    from rlcore.agent.sandbox import Limits, SandboxUnavailable, check, describe, isolation
    from rlcore.errors import ConfigError

    place = _place()
    limits = Limits(backend="process")
    assert isolation(limits)["cgroup_limits"] and isolation(limits)["every_descendant_killed"]
    assert "a control group per call" in describe(limits) and f"cgroup v{place.version}" in describe(limits)
    assert not isolation(Limits(backend="process", cgroup="off"))["cgroup_limits"]
    check(Limits(backend="process", cgroup="required"))  # available here: accepted
    with pytest.raises(ConfigError, match="tools_sandbox.cgroup='sometimes' is invalid: choose auto, off or required"):
        ToolsSandboxConfig(cgroup="sometimes")
    with pytest.raises(ConfigError, match="tools_sandbox.cpus=0 is invalid"):
        ToolsSandboxConfig(cpus=0)
    monkeypatch.setattr(cg, "probe", lambda: (None, "no writable group (test)"))  # a host without one
    with pytest.raises(SandboxUnavailable, match="cgroup: required, but no control group .*no writable group"):
        check(Limits(backend="process", cgroup="required"))
    assert "the rlimits bound each process alone" in describe(Limits(backend="process"))


@pytest.mark.unit
def test_where_the_groups_go_on_other_hosts():
    """The choice of place from a host's mounts and /proc/self/cgroup (this machine is cgroup v1;
    the v2 layouts are read as the kernel writes them, Documentation/admin-guide/cgroup-v2.rst)."""
    from rlcore.agent.sandbox_cgroup import Place, _candidates

    v2 = [("/", "/sys/fs/cgroup", "cgroup2", {"rw"})]
    slurm = "/system.slice/slurmstepd.scope/job_7/step_0/user"
    enabled = {f"/sys/fs/cgroup{slurm}": {"cpuset", "cpu", "io", "memory", "pids"}}
    # Slurm's cgroup/v2 task group: its parent "user" enables the controllers; a root trainer may write it
    got = _candidates(v2, {"": f"{slurm}/task_0"}, lambda d: enabled.get(d, set()), lambda d: True)
    assert got == [Place(2, tuple((c, f"/sys/fs/cgroup{slurm}") for c in ("memory", "pids", "cpu")))]
    # the same as a user: root owns "user", no group; nothing else to try
    assert _candidates(v2, {"": f"{slurm}/task_0"}, lambda d: enabled.get(d, set()), lambda d: False) == []
    # a systemd Delegate=yes service whose own group enables memory and pids (the trainer in a leaf below)
    own = "/system.slice/trainer.service"
    got = _candidates(v2, {"": own}, lambda d: {"memory", "pids"} if d.endswith(".service") else set(),
                      lambda d: True)
    assert got[0] == Place(2, (("memory", f"/sys/fs/cgroup{own}"), ("pids", f"/sys/fs/cgroup{own}")))
    # a hybrid v1 host like this one: v2 mounted without controllers, v1 hierarchies writable
    hybrid = [("/", "/sys/fs/cgroup/unified", "cgroup2", {"rw"}), ("/", "/sys/fs/cgroup/pids", "cgroup", {"rw", "pids"}),
              ("/", "/sys/fs/cgroup/memory", "cgroup", {"rw", "memory"})]
    got = _candidates(hybrid, {"": "/", "pids": "/", "memory": "/box/1"}, lambda d: set(), lambda d: True)
    assert got == [Place(1, (("memory", "/sys/fs/cgroup/memory/box/1"), ("pids", "/sys/fs/cgroup/pids")))]
