"""A judge engine's own sleep on accelerators: its tensors' storages freed and restored in place.

vLLM's sleep mode cannot serve a second engine in one process: vllm 0.32's GPU worker asserts
"CuMem allocator can only be used for one instance per process" when a second engine loads its
weights into the sleep-mode pool (v1/worker/gpu_worker.py:397-403, ``_maybe_get_memory_pool_context``),
and the pool's sleep and wake-up act on every allocation of the process by tag
(device_allocator/cumem.py:233-299, 331-365: the policy engine's too). So a judge is built without
sleep mode, eager (no CUDA graph holds its old addresses), and sleeps here: every distinct storage
behind its parameters, buffers and KV cache is resized to 0 (views keep pointing at the same
storage object) and later resized back; parameters are copied to host memory first (level 1) or
reloaded from the judge's folder after (level 2); buffers (rotary caches, not in checkpoints) are
always copied, as vLLM's own level-2 sleep does (gpu_worker.py:298-306). The policy engine's
sleep-mode pool never holds these allocations, so its sleep and wake-up leave them alone.
Plain torch: the same code runs on CPU tensors in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Released:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # (nbytes,) uint8 copy, or None: contents discarded


def distinct_storages(tensors) -> list[torch.UntypedStorage]:
    """Each storage once (tied weights share one), empty ones left out."""
    seen, out = set(), []
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            out.append(st)
    return out


def _bytes_view(st: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)


def release(storages: list[torch.UntypedStorage], keep: bool) -> list[Released]:
    """Free each storage's memory; ``keep``: copy its bytes to (pinned, on accelerators) host memory first."""
    out = []
    for st in storages:
        host = None
        if keep:
            pin = st.device.type != "cpu" and torch.cuda.is_available()
            host = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(_bytes_view(st))
        out.append(Released(st, st.nbytes(), host))
        st.resize_(0)
    return out


def restore(released: list[Released]) -> None:
    """Re-allocate each storage at its size; copy the kept bytes back, zero the others (KV blocks start
    from zeros as at build; discarded weights are then reloaded)."""
    for r in released:
        r.storage.resize_(r.nbytes)
        view = _bytes_view(r.storage)
        if r.host is not None:
            view.copy_(r.host)
        else:
            view.zero_()


def empty_device_cache(device_type: str) -> None:
    """Hand freed blocks back to the driver, where the policy engine's sleep-mode pool allocates."""
    accel = getattr(torch, device_type, None) if device_type != "cpu" else None
    if accel is not None and hasattr(accel, "empty_cache"):
        accel.empty_cache()
