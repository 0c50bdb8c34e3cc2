"""Test-only real offload on CPU: plain tensors and storages, no FSDP2 or DTensor here
(``rlcore.engine.policy`` hands over the local tensors and owns everything distributed).

On CPU, VeOmni's offload helpers move nothing (``model.cpu()`` of CPU tensors), so a code path
that reads offloaded state would pass every CPU test and break on an accelerator.
``RLCORE_TEST_REAL_OFFLOAD=1`` makes the engine offload through ``HostCopies`` instead: state that
is offloaded lives in a separate host copy, and the original storage holds garbage meanwhile.
"""

from __future__ import annotations

import os

import torch

ENV = "RLCORE_TEST_REAL_OFFLOAD"


class HostCopies:
    """Offloading copies every storage behind the given tensors into a separate buffer and
    overwrites the original with 0xFF bytes (NaN for floats, -1 for integers), so a read of
    offloaded state yields garbage that any exact comparison catches; onloading copies the bytes
    back into the same storages, so every view (FSDP2's padded shard buffers included) sees them.
    The original storage is poisoned rather than freed (``resize_(0)``): a stray read of a freed
    CPU storage segfaults the rank instead of failing a test with a message."""

    def __init__(self):
        self.saved: dict[str, list[tuple[torch.UntypedStorage, torch.UntypedStorage]]] = {}

    @classmethod
    def from_env(cls, device_type: str) -> "HostCopies | None":
        if os.environ.get(ENV, "0") in ("", "0"):
            return None
        if device_type != "cpu":
            raise RuntimeError(f"{ENV}=1 is a CPU test mode; unset it on {device_type}")
        return cls()

    def move(self, what: str, tensors: list[torch.Tensor], to_host: bool) -> None:
        if not to_host:
            for storage, copy in self.saved.pop(what, []):
                storage.copy_(copy)
            return
        assert what not in self.saved, f"{what} offloaded twice"
        storages = {}
        for t in tensors:
            s = t.untyped_storage()
            if s.nbytes():
                storages.setdefault(s.data_ptr(), s)  # views of one buffer share it: copy it once
        self.saved[what] = [(s, s.clone()) for s in storages.values()]
        for s, _ in self.saved[what]:
            torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),), (1,)).fill_(255)

    @staticmethod
    def is_poisoned(t: torch.Tensor) -> bool:
        """For tests: every byte of ``t``'s storage is garbage (0xFF) right now."""
        s = t.untyped_storage()
        return bool((torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),), (1,)) == 255).all())
