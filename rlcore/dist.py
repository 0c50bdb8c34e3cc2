"""Device and torch.distributed set-up: the one module that reads torchrun's environment.

Picks cuda+nccl, npu+hccl (torch_npu imported only where it is installed) or cpu+gloo, and
initialises the default process group for every world size, 1 included.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Callable, NoReturn

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device_type: str  # "cuda" | "npu" | "cpu"
    backend: str  # "nccl" | "hccl" | "gloo"

    @property
    def device(self) -> torch.device:
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, self.local_rank)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def torchrun_env() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) from torchrun's variables; 1 process without."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return rank, world, local_rank, local_world


def npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return torch.npu.is_available()


def detect_device(requested: str = "auto") -> tuple[str, str]:
    """(device_type, backend) for ``requested`` in auto|cuda|npu|cpu."""
    if requested == "auto":
        if torch.cuda.is_available():
            requested = "cuda"
        elif npu_available():
            requested = "npu"
        else:
            requested = "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("parallel.device=cuda but torch.cuda.is_available() is False; use auto or cpu")
    if requested == "npu" and not npu_available():
        raise RuntimeError("parallel.device=npu but torch_npu is missing or sees no NPU; use auto or cpu")
    return requested, {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}[requested]


def init_distributed(device: str = "auto", timeout_s: float = 1800.0) -> DistInfo:
    """Initialise the default process group (idempotent) and bind this rank to its device.

    A run started without torchrun gets a one-process group on a free local port, so the same
    code path (collectives included) runs at N=1.
    """
    rank, world, local_rank, local_world = torchrun_env()
    device_type, backend = detect_device(device)
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    elif device_type == "npu":
        torch.npu.set_device(local_rank)
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
            os.environ.setdefault("LOCAL_RANK", "0")
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return DistInfo(rank, world, local_rank, local_world, device_type, backend)


def run_then_exit(main: Callable[[], object]) -> NoReturn:
    """A rank's entry point: run ``main``, then end with its exit code through ``exit_process``.

    ``SystemExit`` keeps its code (``None`` is 0; a message is printed, code 1, as Python does); any
    other exception is printed by ``sys.excepthook`` and exits 1 (130 for Ctrl-C).
    """
    try:
        main()
        code = 0
    except SystemExit as e:
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException as e:  # noqa: BLE001 - printed like an uncaught exception, then exit
        sys.excepthook(type(e), e, e.__traceback__)
        code = 130 if isinstance(e, KeyboardInterrupt) else 1
    exit_process(code)


def exit_process(code: int = 0, run_atexit: bool = True) -> NoReturn:
    """End this rank after its work is done: atexit handlers, flushed streams, then the C library's
    ``exit``, which skips the interpreter's finalization, where gloo can abort a finished run.

    ``destroy_process_group()`` unregisters gloo's groups, but their C++ objects and worker threads
    live on while anything holds them (VeOmni's parallel state, torch's caches). A worker that has
    just finished a collective frees its tensors, which needs the GIL; if the main thread has
    begun finalizing, CPython ends that thread with ``pthread_exit`` inside a noexcept C++
    destructor: "terminate called without an active exception", SIGABRT, and torchrun reports the
    run failed after it wrote everything (about 1 exit in 30 on 2 CPU ranks here; gdb:
    ``~AsyncAllgatherCoalescedWork`` -> ``take_gil`` -> ``PyThread_exit_thread``; the open upstream
    report is pytorch/pytorch#190489). ``atexit`` handlers (logging, tensorboard, tempfile) run
    first, while the interpreter is whole. ``exit`` is called through ``PyDLL`` so the GIL stays
    held: C++ static destructors still run (vLLM's CPU tensor-parallel communicator unlinks its
    /dev/shm files there; ``os._exit`` would leave them, and the next tp=2 engine on the host
    fails with "create shm in SHMManager failed. errno: 17"), and a gloo thread waiting for the
    GIL just waits until the process is gone. ``run_atexit=False``: a preempted rank with little
    time left skips the handlers, as it skips the engines' shutdown.
    """
    if run_atexit:
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing left to save
            pass
    ctypes.PyDLL(None).exit(code)
    os._exit(code)  # not reached


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum a few python numbers over all ranks (float64 on CPU: exact for counts)."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() != "gloo":
            t = t.to(_comm_device())
        dist.all_reduce(t)
    return t.cpu().tolist()


def all_reduce_max(values: list[float]) -> list[float]:
    """Element-wise max of a few python numbers over all ranks."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() != "gloo":
            t = t.to(_comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def node_of_each_rank() -> list[int]:
    """The node (torchrun agent, ``GROUP_RANK``) of every rank, in rank order; collective."""
    return all_gather_objects(int(os.environ.get("GROUP_RANK", "0")))


def all_gather_objects(obj, group=None) -> list:
    """Every rank's picklable ``obj``, in rank order, on every rank of ``group`` (None: the world)."""
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return [obj]
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, obj, group=group)  # NCCL/HCCL: goes through the current device
    return parts


def _comm_device() -> torch.device:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    if hasattr(torch, "npu"):
        return torch.device("npu", torch.npu.current_device())
    return torch.device("cpu")


def memory_stats(device_type: str) -> dict[str, float]:
    """Allocated/reserved GB on accelerators; process RSS (GB) on CPU."""
    if device_type == "cuda":
        return {
            "allocated_gb": torch.cuda.memory_allocated() / 2**30,
            "reserved_gb": torch.cuda.memory_reserved() / 2**30,
        }
    if device_type == "npu":
        return {
            "allocated_gb": torch.npu.memory_allocated() / 2**30,
            "reserved_gb": torch.npu.memory_reserved() / 2**30,
        }
    return {"rss_gb": _rss_bytes() / 2**30}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def empty_cache(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.empty_cache()
    elif device_type == "npu":
        torch.npu.empty_cache()


def all_rank_sums(values: dict[str, float]) -> dict[str, float]:
    """Each named value summed over all ranks, in one all-reduce (collective: every rank passes
    the same keys)."""
    keys = sorted(values)
    return dict(zip(keys, all_reduce_sum([values[k] for k in keys])))


def all_rank_means(values: dict[str, float], world_size: int) -> dict[str, float]:
    """Means over ranks of per-rank values (of equal-sized shares: their mean is the global one)."""
    return {k: v / world_size for k, v in all_rank_sums(values).items()}
