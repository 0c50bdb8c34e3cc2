"""On-policy distillation's per-token signal (pure tensor math; rlcore.distill drives it).

The student samples y ~ pi_student; the teacher scores the same tokens. The per-token reverse KL
estimate on a sampled token is ``log pi_student(y_t) - log pi_teacher(y_t)``, and its score-function
gradient is that value (no discounting: each token is its own return) times ``grad log pi_student``,
so the policy-gradient loss does the rest when it gets

    A_t = -(log pi_student(y_t) - log pi_teacher(y_t))          (N, T), 0 off the mask

as a per-token advantage (Agarwal et al. 2024, GKD; the on-policy distillation of Thinking
Machines' Tinker cookbook and of verl/slime). Beside a reward, the two advantages are summed:
``reward_weight * A_reward + coef * A_distill``.

Modes are a registry (``name -> function``) whose error lists the valid names.
"""

from __future__ import annotations

from typing import Callable

import torch

_MODES: dict[str, Callable] = {}


def _mode(name: str):
    def register(fn: Callable) -> Callable:
        _MODES[name] = fn
        return fn

    return register


@_mode("reverse_kl")
def reverse_kl_advantage(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N, T) ``-(student - teacher)`` on the mask, 0 elsewhere (positive where the teacher likes the
    token more than the student does)."""
    return -(student_logp - teacher_logp) * mask


MODES = tuple(sorted(_MODES))


def distill_advantage(mode: str, student_logp: torch.Tensor, teacher_logp: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
    if mode not in _MODES:
        raise ValueError(f"unknown distillation mode {mode!r}; valid: {', '.join(MODES)}")
    return _MODES[mode](student_logp, teacher_logp, mask)


def combine(reward_adv: torch.Tensor, distill_adv: torch.Tensor, coef: float, reward_weight: float) -> torch.Tensor:
    """(N, T) the advantage the loss gets: ``reward_weight * reward_adv + coef * distill_adv``
    (``reward_weight`` 0: the reward's advantage does not enter, not even as NaN or inf)."""
    out = coef * distill_adv
    return out + reward_weight * reward_adv if reward_weight else out


def distill_sums(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """This rank's sums for the ``distill/*`` metrics (the caller adds them over ranks)."""
    return {"tokens": float(mask.sum()), "kl": float(((student_logp - teacher_logp) * mask).sum()),
            "teacher": float((teacher_logp * mask).sum()), "student": float((student_logp * mask).sum())}
