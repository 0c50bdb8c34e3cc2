"""Release and restore vLLM's KV cache buffer on CPU, where vLLM has no sleep mode: the storage
behind every layer's KV view is resized to 0 and back, then zeroed lazily (whole pages dropped
with madvise). Plain torch and libc; used by ``rlcore.colocate_rollout`` only."""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys

import torch

log = logging.getLogger(__name__)


def _cpu_kv_storages(model_runner) -> list[torch.UntypedStorage]:
    """Distinct storages behind the per-layer KV tensors (on CPU: one buffer viewed by all)."""
    seen, storages = set(), []
    for kv in model_runner.kv_caches:
        st = kv.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            storages.append(st)
    return storages


def release_cpu_kv(model_runner) -> list[tuple[torch.UntypedStorage, int]]:
    # resize_(0) frees the allocation while every view (layers, attention metadata) keeps
    # pointing at the same storage object, so resize_(nbytes) later restores them all.
    released = []
    for st in _cpu_kv_storages(model_runner):
        released.append((st, st.nbytes()))
        st.resize_(0)
    return released


def resume_cpu_kv(released: list[tuple[torch.UntypedStorage, int]]) -> None:
    for st, nbytes in released:
        st.resize_(nbytes)
        # Fresh memory is uninitialised; NaN garbage in not-yet-written slots of a block
        # could leak through masked attention (0 * NaN), so start from zeros like at build.
        _zero_lazily(st)


_MADV_DONTNEED = 4


def _zero_lazily(st: torch.UntypedStorage) -> None:
    """Zero a CPU storage without touching most of it.

    ``fill_(0)`` would fault in every page of the buffer at once (0.3 s for 256 MiB here) though
    a generation touches only the blocks it uses. ``madvise(MADV_DONTNEED)`` drops the whole pages
    instead: private anonymous memory (what the CPU allocator hands out) reads back as zeros on
    first touch. The partial pages at both ends are zeroed by hand; anything else falls back to
    ``fill_(0)``.
    """
    ptr, nbytes, page = st.data_ptr(), st.nbytes(), mmap.PAGESIZE
    start = min(-(-ptr // page) * page, ptr + nbytes)  # first whole page
    end = max((ptr + nbytes) // page * page, start)  # end of the last whole page
    raw = torch.empty(0, dtype=torch.uint8).set_(st)  # (nbytes,) byte view of the storage
    if end > start and _madvise(start, end - start, _MADV_DONTNEED):
        raw[: start - ptr].zero_()
        raw[end - ptr:].zero_()
    else:
        raw.zero_()


def _madvise(addr: int, length: int, advice: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(addr, length, advice) == 0


def remove_stale_cpu_shm() -> list[str]:
    """vLLM's CPU tensor-parallel communicator maps /dev/shm files (``-tp:0-[0-1]-run<port>-cpushm_N``
    with ``scope_cpu_shm_names``); a run killed mid-way (kill -9, OOM) leaves them behind, and the next
    tp > 1 engine on the host then fails with "create shm in SHMManager failed. errno: 17". Remove
    those no live process maps (another job's live ones stay); returns the removed paths."""
    import glob
    import os

    stale = set(glob.glob("/dev/shm/*cpushm*"))
    for maps in glob.glob("/proc/[0-9]*/maps") if stale else []:
        try:
            with open(maps) as f:
                text = f.read()
        except OSError:
            continue
        stale = {path for path in stale if path not in text}
    removed = []
    for path in sorted(stale):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def scope_cpu_shm_names(token: str | None = None) -> str | None:
    """Name this launch's CPU tensor-parallel shm files after it. vLLM names them from
    ``VLLM_DIST_IDENT``, which the CPU worker derives from the distributed init method (vllm 0.32.0
    v1/worker/cpu_worker.py:147-152): under torchrun (external_launcher, ``env://``) every launch
    on a host gets the same one, so two live runs with tp > 1 on one host open each other's files
    and the second fails ("errno: 17"). The group name (distributed/device_communicators/
    cpu_communicator.py:236-243, ``_CPUSHMDistributed.make_group_name``) gets ``token`` (default:
    torchrun's MASTER_PORT, equal on a launch's ranks and distinct between live launches) before
    ``-cpushm``. Idempotent; returns the token in effect (None: nothing to scope by)."""
    import os

    from vllm.distributed.device_communicators import cpu_communicator as cc

    token = token or os.environ.get("MASTER_PORT")
    make = cc._CPUSHMDistributed.make_group_name
    original = getattr(make, "_rlcore_original", make)
    if token is None:
        return None

    def make_group_name(communicator) -> str:
        return original(communicator).replace("-cpushm", f"-run{token}-cpushm")

    make_group_name._rlcore_original = original
    cc._CPUSHMDistributed.make_group_name = staticmethod(make_group_name)
    return token


def clear_stale_cpu_shm(info) -> None:
    """Local rank 0 removes the CPU TP communicator's files a killed run left; every rank waits
    for it before any engine creates its own (collective, like the engine build)."""
    import torch.distributed as dist

    if info.local_rank == 0:
        removed = remove_stale_cpu_shm()
        if removed:
            log.warning("removed %d stale vLLM CPU shared-memory files of a killed run: %s", len(removed), removed)
    if dist.is_initialized():
        dist.barrier()
