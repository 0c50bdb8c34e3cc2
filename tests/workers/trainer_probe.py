"""Run train_grpo.py's main exactly as ``python train_grpo.py ARGS`` would, then report on stderr
the exit code, which engine packages (vllm, veomni) had been imported (a run stopped by bad input
must end before either is), and every attempt to reach a non-local address: Python's audit hooks
see each ``socket.connect`` and ``socket.getaddrinfo`` (HTTP clients, hub downloads, telemetry).
The process group's own sockets (C++, localhost under torchrun --standalone) are not Python calls.
Used by tests/test_bad_inputs.py and tests/test_resume.py, with and without torchrun."""

import ipaddress
import os
import runpy
import socket
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(REPO, "train_grpo.py")
LOCAL_NAMES = {"localhost", "", None, socket.gethostname()}
remote: list[str] = []


def _is_local(host) -> bool:
    if isinstance(host, bytes):
        host = host.decode()
    if host in LOCAL_NAMES:
        return True
    try:
        ip = ipaddress.ip_address(str(host).split("%")[0])
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified


def _audit(event: str, args) -> None:
    if event == "socket.connect":
        sock, address = args[0], args[1]
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _is_local(address[0]):
            kind = "udp" if sock.type == socket.SOCK_DGRAM else "tcp"
            remote.append(f"connect:{kind}:{address[0]}:{address[1]}")
    elif event == "socket.getaddrinfo" and not _is_local(args[0]):
        remote.append(f"getaddrinfo:{args[0]}")


def _report(code: int) -> None:
    engines = sorted(m for m in ("vllm", "veomni") if m in sys.modules)
    print(f"probe: rank {os.environ.get('RANK', '0')} exit {code} engines_imported={engines} "
          f"remote_network={sorted(set(remote))}", file=sys.stderr, flush=True)


sys.addaudithook(_audit)
sys.path.insert(0, REPO)
sys.argv = [TRAIN, *sys.argv[1:]]
# train_grpo.py ends through rlcore.dist.exit_process (os._exit): report on the way out.
from rlcore import dist  # noqa: E402

_exit_process = dist.exit_process


def _exit_with_report(code: int = 0):
    _report(code)
    _exit_process(code)


dist.exit_process = _exit_with_report
runpy.run_path(TRAIN, run_name="__main__")
