"""The policy engine's offload: where its parameters and optimizer state are (``OffloadState``, a
part of ``rlcore.engine_veomni.VeOmniPolicy``), and the test-only real offload on CPU (``HostCopies``).

On CPU, VeOmni's offload helpers move nothing (``model.cpu()`` of CPU tensors), so a code path
that reads offloaded state would pass every CPU test and break on an accelerator.
``RLCORE_TEST_REAL_OFFLOAD=1`` makes the engine offload through ``HostCopies`` instead: state that
is offloaded lives in a separate host copy, and the original storage holds garbage meanwhile.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch.distributed.tensor import DTensor

from rlcore.dist import empty_cache

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


class OffloadState:
    """The offload half of ``VeOmniPolicy``: ``offloaded`` says where parameters and optimizer state
    are; every method keeps it true. Reads the engine's ``model``, ``optimizer`` (None when frozen),
    ``device``, ``info``, ``_host_copies``, ``_reshard()`` and ``_inner_optimizers()``."""

    offloaded: dict[str, bool]

    def offload(self, params: bool = True, optimizer: bool = True) -> None:
        """Move parameter shards and/or optimizer state to the host (frees accelerator memory for
        rollout). Idempotent: state already offloaded stays where it is. On CPU VeOmni's helpers
        run and move nothing, unless RLCORE_TEST_REAL_OFFLOAD=1; the bookkeeping is the same."""
        params = params and not self.offloaded["params"]
        optimizer = optimizer and self.optimizer is not None and not self.offloaded["optimizer"]
        if params:
            self._reshard()  # only sharded parameters go to the host: no gathered copies left behind
            self._move("params", to_host=True)
        if optimizer:
            self._move("optimizer", to_host=True)
        if params or optimizer:
            empty_cache(self.info.device_type)

    def onload(self, params: bool = True, optimizer: bool = True) -> None:
        """Inverse of ``offload``; idempotent too."""
        for what, wanted in (("params", params), ("optimizer", optimizer)):
            if wanted and self.offloaded[what]:
                self._move(what, to_host=False)

    def on_device(self):
        """``with ref.on_device(): ...``: parameters on the device for the whole block (one move
        in, one out, however many forwards run inside), back where they were afterwards."""
        return self._resident(params=True)

    @contextlib.contextmanager
    def _resident(self, params: bool = False, optimizer: bool = False):
        """Load what the block needs and is offloaded now; offload it again afterwards (also when
        the block raises), so that the caller's phase is unchanged."""
        moved = {"params": params and self.offloaded["params"], "optimizer": optimizer and self.offloaded["optimizer"]}
        self.onload(**moved)
        try:
            yield
        finally:
            self.offload(**moved)

    def _require_resident(self, what: str, params: bool = False, optimizer: bool = False) -> None:
        away = [k for k, need in (("params", params), ("optimizer", optimizer)) if need and self.offloaded[k]]
        if away:
            raise RuntimeError(f"{what} while the policy's {' and '.join(away)} are offloaded to the host; call "
                               f"onload() first (the phase switch's to_training does)")

    @torch.no_grad()
    def _move(self, what: str, to_host: bool) -> None:
        """One kind of state, one direction: veomni 0.1.12 veomni/distributed/offloading.py:124-199
        (``model.cpu()`` / ``model.to(device)``, which FSDP2 follows by re-pointing its shards,
        torch 2.13 torch/distributed/fsdp/_fully_shard/_fully_shard.py:886-899; each optimizer
        state tensor moved in place)."""
        from veomni.distributed import offloading as off

        if self._host_copies is not None:
            self._host_copies.move(what, self._state_tensors(what), to_host)
        elif what == "params":
            off.offload_model_to_cpu(self.model, False) if to_host else off.load_model_to_gpu(self.model, self.device)
        else:
            off.offload_optimizer(self.optimizer) if to_host else off.load_optimizer(self.optimizer, self.device)
        self.offloaded[what] = to_host

    def _state_tensors(self, what: str) -> list[torch.Tensor]:
        """The plain local tensors holding parameters and buffers, or optimizer state."""
        if what == "params":
            tensors = [*self.model.parameters(), *self.model.buffers()]
        else:
            tensors = [v for opt in self._inner_optimizers() for state in opt.state.values()
                       for v in state.values() if torch.is_tensor(v)]
        return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
