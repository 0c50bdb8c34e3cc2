"""What the loop needs from the two engines: the trainer (``Policy``) and the generator
(``Rollout``). The loop, the phase switch and the sampling code are written against these; the
real engines (``rlcore.engine_veomni``, ``rlcore.colocate_rollout``) and the tests' fakes provide
them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Policy(Protocol):
    """The trainer engine (``rlcore.engine_veomni.VeOmniPolicy``). Every method that runs a
    forward, gathers weights or touches a checkpoint is collective."""

    lr_schedule_changes: list[str]

    def forward_logprobs(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor,
                         temperature: float = 1.0, with_entropy: bool = False, grad: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor | None]: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self) -> dict: ...
    def named_hf_weights_bucketed(self, dtype=None, bucket_mb: float = 64.0, fused_experts: bool = False
                                  ) -> Iterator[tuple[str, torch.Tensor]]: ...
    def sync_plan_summary(self, dtype=None, bucket_mb: float = 64.0) -> dict: ...
    def offload(self, params: bool = True, optimizer: bool = True) -> None: ...
    def onload(self, params: bool = True, optimizer: bool = True) -> None: ...
    def on_device(self) -> AbstractContextManager: ...
    def save_checkpoint(self, path: str, extra_state: dict | None = None) -> None: ...
    def load_checkpoint(self, path: str) -> dict: ...
    def save_hf(self, path: str, dtype: str = "float32") -> None: ...
    def describe(self) -> str: ...
    def routing(self, mode: str | None, rows: tuple | None = None) -> AbstractContextManager: ...
    def routing_metrics(self) -> dict[str, float]: ...


@runtime_checkable
class Rollout(Protocol):
    """The generation engine (``rlcore.colocate_rollout.ColocateRollout``): one vLLM engine per
    tensor-parallel group; ``dp_*`` name the replica, ``tp_*`` the rank inside it."""

    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int
    weights_valid: bool
    released: frozenset
    fused_experts: bool | None  # MoE: its loader takes a layer's experts as two fused tensors; None: dense

    def generate(self, prompts: list[list[int]], *, n: int, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = -1, max_tokens: int = 64, seed: int | None = None,
                 stop_token_ids: list[int] | None = None) -> list: ...
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, full: bool = True) -> int: ...
    def release_memory(self) -> None: ...
    def resume_memory(self, tags: list[str] | None = None) -> None: ...
    def shutdown(self, exiting: bool = False) -> None: ...
    def describe(self) -> str: ...


class EngineSection(Protocol):
    """What a judge's or teacher's engine (``rlcore.rollout.judge.JudgeEngine``) reads of its config
    section: ``rlcore.judge.config.JudgeConfig`` and ``rlcore.distill.config.DistillConfig`` both have
    it, and the rollout wing needs neither wing's module to read it. (A generative judge's
    ``generate`` also reads ``temperature`` and ``max_tokens``, which a teacher never calls.)"""

    name: str
    path: str
    generative: bool
    max_model_len: int
    kv_cache_gb: float
    gpu_memory_utilization: float
    sleep_level: int | None
