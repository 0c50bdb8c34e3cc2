"""A real Slurm on this host for tests: munged, slurmctld and one slurmd per node name, all from a
generated ``slurm.conf`` in a temporary folder (its own ports and munge socket, nothing under /etc).

Several slurmd daemons on one host, each with its own ``NodeName`` and port (``slurmd -N``), work
with Debian's Slurm 22.05 (bookworm's ``slurm-wlm``), so a job can span two "nodes" that are this
machine. ``NodeAddr=127.0.0.1``: the node names themselves do not resolve, as on clusters whose
node names are not host names. Root only (slurmd starts the jobs' processes); the tests skip where
the binaries are missing or the user is not root, unless ``RLCORE_REQUIRE_SLURM=1`` (CI) makes that a
failure."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")


def missing() -> str | None:
    """Why no cluster can start here (None: it can)."""
    absent = [b for b in BINARIES if shutil.which(b) is None]
    if absent:
        return f"not installed: {', '.join(absent)} (apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs"
    return None


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SlurmCluster:
    def __init__(self, root: str, nodes: tuple[str, ...] = ("n1", "n2", "n3"), cpus: int = 2):
        self.root, self.nodes = root, nodes
        self.conf = os.path.join(root, "slurm.conf")
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        for sub in ("munge", "state", "spool", "log"):
            os.makedirs(os.path.join(root, sub), exist_ok=True)
        os.chmod(os.path.join(root, "munge"), 0o700)
        self.sock = os.path.join(root, "munge", "sock")
        self.procs: list[subprocess.Popen] = []
        ctl_port, *node_ports = free_ports(1 + len(nodes))
        node_lines = [f"NodeName={n} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 Port={p} "
                      f"CPUs={cpus} RealMemory=4000 State=UNKNOWN" for n, p in zip(nodes, node_ports)]
        with open(self.conf, "w") as f:
            f.write("\n".join([
                "ClusterName=rlcoretest", f"SlurmctldHost={socket.gethostname()}(127.0.0.1)",
                f"SlurmctldPort={ctl_port}", "AuthType=auth/munge", f"AuthInfo=socket={self.sock}",
                "CredType=cred/munge", "SlurmUser=root", "SlurmdUser=root",
                f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool/%n",
                f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd-%n.pid",
                f"SlurmctldLogFile={root}/log/slurmctld.log", f"SlurmdLogFile={root}/log/slurmd-%n.log",
                "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
                "SchedulerType=sched/builtin", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
                "MpiDefault=none", "ReturnToService=2", "KillWait=10", "MinJobAge=600", "PlugStackConfig=/dev/null",
                *node_lines, "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""]))

    def start(self, timeout: float = 60) -> "SlurmCluster":
        key = os.path.join(self.root, "munge", "key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o600)
        m = os.path.join(self.root, "munge")
        self._spawn(["munged", "-F", "-f", "-S", self.sock, f"--key-file={key}", f"--log-file={m}/log",
                     f"--pid-file={m}/pid", f"--seed-file={m}/seed"])
        self._until(lambda: os.path.exists(self.sock), timeout, "munged's socket")
        self._spawn(["slurmctld", "-D", "-i", "-f", self.conf])
        for node in self.nodes:
            self._spawn(["slurmd", "-D", "-N", node, "-f", self.conf])
        self._until(lambda: self.idle_nodes() == len(self.nodes), timeout, f"{len(self.nodes)} idle nodes")
        return self

    def _spawn(self, cmd: list[str]) -> None:
        log = open(os.path.join(self.root, "log", cmd[0] + (cmd[3] if cmd[0] == "slurmd" else "") + ".out"), "w")
        self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))

    def _until(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"a Slurm daemon exited while waiting for {what}: {self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} within {timeout} s: {self.logs()}")
            time.sleep(0.3)

    def run(self, *cmd: str, check: bool = True) -> str:
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stdout}{proc.stderr}")
        return proc.stdout

    def idle_nodes(self) -> int:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env, capture_output=True, text=True).stdout
        return sum(line.strip() == "idle" for line in out.splitlines())

    def until_idle(self, nodes: tuple[str, ...], timeout: float = 60) -> None:
        def idle() -> bool:
            out = self.run("sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%T")
            return out.split() == ["idle"] * len(nodes)

        self._until(idle, timeout, f"nodes {nodes} idle")

    def sbatch(self, *args: str, env: dict | None = None, cwd: str | None = None) -> int:
        out = subprocess.run(["sbatch", "--parsable", *args], env={**self.env, **(env or {})}, cwd=cwd,
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch exited {out.returncode}: {out.stdout}{out.stderr}")
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job -o`` as a dict (JobState, ExitCode, Restarts, NodeList...)."""
        line = self.run("scontrol", "show", "job", str(job_id), "-o")
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def wait_state(self, job_id: int, states: tuple[str, ...], timeout: float = 300) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not in {states} within {timeout} s: {info}")
            time.sleep(0.5)

    def logs(self) -> str:
        text = []
        for name in sorted(os.listdir(os.path.join(self.root, "log"))):
            with open(os.path.join(self.root, "log", name), errors="replace") as f:
                text.append(f"--- {name}\n" + f.read()[-2000:])
        return "\n".join(text)

    def stop(self) -> None:
        """Cancel every job, stop the daemons, then kill whatever still carries this cluster's
        SLURM_CONF (a failed test's job: srun, slurmstepd, frozen ranks)."""
        subprocess.run(["scancel", "--user=root"], env=self.env, capture_output=True)
        deadline = time.monotonic() + 30
        while self.run("squeue", "-h", check=False).strip() and time.monotonic() < deadline:
            time.sleep(0.5)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        mark = f"SLURM_CONF={self.conf}".encode()
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark in f.read().split(b"\0") and int(entry) != os.getpid():
                        os.kill(int(entry), 9)
            except (OSError, ValueError):
                continue
