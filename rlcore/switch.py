"""The phase machine: the one place that orders the switch between training and generation.

to_generation:  offload optimizer -> wake vLLM weights -> push new weights -> offload trainer params
                -> wake vLLM KV cache
to_training:    release vLLM memory (KV cache; weights too at sleep level 2) -> load trainer params
                and optimizer state

On CPU the offload and sleep steps are no-ops by the engines' own choice (sleeping a CPU engine
hangs it), but the same sequence runs, so the CPU tests exercise the accelerator's code path.
"""

from __future__ import annotations

import logging

from rlcore.dist import memory_stats

log = logging.getLogger("rlcore.switch")


class PhaseSwitcher:
    def __init__(self, policy, rollout, timer, device_type: str, *, offload_params: bool,
                 offload_optimizer: bool, free_kv_cache: bool, rollout_dtype=None):
        self.policy, self.rollout, self.timer = policy, rollout, timer
        self.device_type = device_type
        self.offload_params, self.offload_optimizer = offload_params, offload_optimizer
        self.free_kv_cache, self.rollout_dtype = free_kv_cache, rollout_dtype
        self.phase = "generation"  # a fresh engine holds the initial weights already
        self.memory: dict[str, float] = {}

    def to_generation(self) -> None:
        """Called after every optimizer step: guarantees a full weight push before generating."""
        assert self.phase == "training", f"to_generation from {self.phase}"
        with self.timer("offload"):
            if self.offload_optimizer:
                self.policy.offload(params=False, optimizer=True)
        with self.timer("wake"):
            self.rollout.resume_memory(tags=["weights"])
        with self.timer("weight_sync"):
            self.rollout.update_weights(self.policy.named_hf_weights(dtype=self.rollout_dtype))
        with self.timer("offload"):
            if self.offload_params:
                self.policy.offload(params=True, optimizer=False)
        with self.timer("wake"):
            self.rollout.resume_memory(tags=["kv_cache"])
        self._record("generation")
        self.phase = "generation"
        log.debug("phase -> generation")

    def to_training(self) -> None:
        assert self.phase == "generation", f"to_training from {self.phase}"
        with self.timer("offload"):
            if self.free_kv_cache:
                self.rollout.release_memory()
            self.policy.onload(params=self.offload_params, optimizer=self.offload_optimizer)
        self._record("training")
        self.phase = "training"
        log.debug("phase -> training")

    def _record(self, phase: str) -> None:
        for key, value in memory_stats(self.device_type).items():
            self.memory[f"memory/{phase}_{key}"] = value

    def pop_metrics(self) -> dict[str, float]:
        out, self.memory = self.memory, {}
        return out
