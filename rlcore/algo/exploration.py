"""Exploration that lasts: the adaptive entropy coefficient carried from step to step.

The per-token mechanisms are pure tensor math in rlcore.advantage (``clip_cov_weights``); this
module holds what has state across steps, so a checkpoint can carry it and resume stays exact.
"""

from __future__ import annotations

import dataclasses

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only
    from rlcore.algo.config import AlgorithmConfig, ExplorationConfig


def next_entropy_coef(coef: float, entropy: float, target: float, step: float, ceiling: float) -> float:
    """Skywork-OR1's adaptive entropy control: one step up when the measured entropy is below the
    target, one step down when above, clamped to [0, ceiling]. A fixed bonus large enough to stop
    the collapse early keeps pushing once the policy is confident; this one switches itself off
    while the entropy stays above the target."""
    if entropy < target:
        coef += step
    elif entropy > target:
        coef -= step
    return min(max(coef, 0.0), ceiling)


@dataclasses.dataclass
class EntropyControl:
    """The entropy coefficient of the next update: algorithm.entropy_coef, or with
    exploration.entropy_target the adaptive one, updated from each step's ``actor/entropy``."""

    algo: AlgorithmConfig
    cfg: ExplorationConfig
    coef: float = dataclasses.field(init=False)

    def __post_init__(self):
        self.coef = self.algo.entropy_coef

    def algorithm(self) -> AlgorithmConfig:
        """The algorithm section this step trains with (its entropy_coef the current one)."""
        if self.cfg.entropy_target is None:
            return self.algo
        return dataclasses.replace(self.algo, entropy_coef=self.coef)

    def after_step(self, metrics: dict) -> dict[str, float]:
        """Move the coefficient from this step's entropy; the coefficient used, for the metrics row."""
        if self.cfg.entropy_target is None:
            return {}
        used = self.coef
        self.coef = next_entropy_coef(used, metrics["actor/entropy"], self.cfg.entropy_target,
                                      self.cfg.entropy_coef_step, self.cfg.entropy_coef_max)
        return {"actor/entropy_coef": used}

    def state_dict(self) -> dict:
        return {"entropy_coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = state.get("entropy_coef", self.algo.entropy_coef)


def clip_cov_options(cfg: ExplorationConfig) -> dict | None:
    """advantage.clip_cov_weights' settings, or None when Clip-Cov is off."""
    if cfg.clip_cov_ratio <= 0:
        return None
    return {"ratio": cfg.clip_cov_ratio, "low": cfg.clip_cov_lb, "high": cfg.clip_cov_ub}
