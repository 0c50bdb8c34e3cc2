"""What building a vLLM engine clobbers in the process, saved and restored around the build, and
the torch RNG state that keeps vLLM's sampling stream apart from the trainer's
(``rlcore.colocate_rollout``)."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
import torch

# Env vars vLLM rewrites at engine build: LOCAL_WORLD_SIZE := tp_size (breaks anything that
# reads torchrun's value later), LD_PRELOAD := tcmalloc (leaks into subprocesses we start).
# VLLM_CPU_KVCACHE_SPACE is hidden during the build (it overrides kv_cache_memory_bytes).
ENV_KEYS_TO_RESTORE = ("LOCAL_WORLD_SIZE", "LD_PRELOAD", "VLLM_CPU_KVCACHE_SPACE")


def accel_module(device_type: str):
    """torch.cuda / torch.npu, or None on CPU."""
    return None if device_type == "cpu" else getattr(torch, device_type)


def get_torch_rng(device_type: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    # Only the current accelerator's generator: *_all() would create contexts on every device.
    accel = accel_module(device_type)
    return torch.get_rng_state(), (accel.get_rng_state() if accel is not None else None)


def set_torch_rng(device_type: str, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    accel = accel_module(device_type)
    if accel is not None and state[1] is not None:
        accel.set_rng_state(state[1])


@dataclass
class ProcessState:
    """What vLLM's engine build clobbers and the trainer relies on."""

    torch_rng: tuple[torch.Tensor, torch.Tensor | None]
    py_rng: object
    np_rng: dict
    env: dict[str, str | None]

    @classmethod
    def capture(cls, device_type: str) -> "ProcessState":
        return cls(
            torch_rng=get_torch_rng(device_type),
            py_rng=random.getstate(),
            np_rng=np.random.get_state(legacy=False),
            env={k: os.environ.get(k) for k in ENV_KEYS_TO_RESTORE},
        )

    def restore(self, device_type: str) -> None:
        # The worker calls set_random_seed(seed) -> reseeds torch, python and numpy globally.
        set_torch_rng(device_type, self.torch_rng)
        random.setstate(self.py_rng)
        np.random.set_state(self.np_rng)
        for k, v in self.env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
