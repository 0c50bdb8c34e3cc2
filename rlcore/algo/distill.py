"""On-policy distillation's per-token signal (pure tensor math; rlcore.distill drives it).

The student samples y ~ pi_student; the teacher scores the same tokens. The per-token reverse KL
estimate on a sampled token is ``log pi_student(y_t) - log pi_teacher(y_t)``, and its score-function
gradient is that value (no discounting: each token is its own return) times ``grad log pi_student``,
so the policy-gradient loss does the rest when it gets

    A_t = -(log pi_student(y_t) - log pi_teacher(y_t))          (N, T), 0 off the mask

as a per-token advantage (Agarwal et al. 2024, GKD; the on-policy distillation of Thinking
Machines' Tinker cookbook and of verl/slime). Beside a reward, the two advantages are summed:
``reward_weight * A_reward + coef * A_distill``.

``topk`` mode (GKD's generalised divergences on a support the teacher chooses): at every response
position the teacher's top-k tokens, plus one "tail" bin holding the rest of each distribution's
mass, form a (k + 1)-way distribution for both models; the per-token divergence between them is a
differentiable loss term (its gradient reaches the student through its k log-probs), weighted by
``coef`` beside the policy-gradient loss. Coarsening to k + 1 bins never increases a divergence (the
data-processing inequality), so the term is a lower bound of the full-vocabulary one that tightens
as the teacher's top-k mass (``distill/topk_mass``) approaches 1 (the tail bin, as in DistillKit and
the top-k variants of verl/slime's distillation losses; renormalising over the k tokens would instead
drop the mass the student puts elsewhere).

Modes and divergences are registries (``name -> function``) whose errors list the valid names.
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
def reverse_kl_advantage(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor,
                         clamp: float | None = None) -> torch.Tensor:
    """(N, T) ``-(student - teacher)`` on the mask, 0 elsewhere (positive where the teacher likes the
    token more than the student does); ``clamp`` bounds the log-ratio first, as verl's
    distillation_loss.loss_max_clamp (verl/trainer/distillation/losses.py:258-260)."""
    k1 = student_logp - teacher_logp  # (N, T)
    if clamp is not None:
        k1 = k1.clamp(-clamp, clamp)
    return -k1 * mask


MODES = tuple(sorted([*_MODES, "topk"]))  # topk: a loss term (topk_divergence), not an advantage


def distill_advantage(mode: str, student_logp: torch.Tensor, teacher_logp: torch.Tensor,
                      mask: torch.Tensor, clamp: float | None = None) -> torch.Tensor:
    """(N, T) the distillation advantage; 0 in topk mode (its signal is the loss term)."""
    if mode == "topk":
        return torch.zeros_like(mask)
    if mode not in _MODES:
        raise ValueError(f"unknown distillation mode {mode!r}; valid: {', '.join(MODES)}")
    return _MODES[mode](student_logp, teacher_logp, mask, clamp)


# ----------------------------------------------------------------------------- top-k divergences

_EPS = 1e-12


def with_tail(logp: torch.Tensor) -> torch.Tensor:
    """(..., k) log-probs of k tokens -> (..., k + 1) probabilities, the last bin the rest of the mass."""
    p = logp.exp()
    tail = (1.0 - p.sum(-1, keepdim=True)).clamp(min=0.0)
    return torch.cat([p, tail], -1)


def _kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(...,) sum_i p_i log(p_i / q_i) over the last dim; 0 log 0 = 0."""
    return (p * (torch.log(p.clamp(min=_EPS)) - torch.log(q.clamp(min=_EPS)))).sum(-1)


def _forward_kl(p, q, beta):  # KL(teacher || student): mode-covering
    return _kl(p, q)


def _reverse_kl(p, q, beta):  # KL(student || teacher): mode-seeking
    return _kl(q, p)


def _jsd(p, q, beta):
    """GKD's generalised JSD(beta) = beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q
    (Agarwal et al. 2024, eq. 3; beta 0.5 the usual JSD; TRL's generalized_jsd_loss)."""
    m = beta * p + (1 - beta) * q
    return beta * _kl(p, m) + (1 - beta) * _kl(q, m)


DIVERGENCES = {"forward_kl": _forward_kl, "reverse_kl": _reverse_kl, "jsd": _jsd}


def topk_divergence(kind: str, teacher_topk_logp: torch.Tensor, student_topk_logp: torch.Tensor,
                    beta: float = 0.5) -> torch.Tensor:
    """(N, T) per-token divergence between teacher (p) and student (q) on the teacher's top-k tokens
    plus the tail bin; inputs (N, T, k) log-probs of the same token ids. Differentiable in the student."""
    if kind not in DIVERGENCES:
        raise ValueError(f"unknown top-k divergence {kind!r}; valid: {', '.join(sorted(DIVERGENCES))}")
    return DIVERGENCES[kind](with_tail(teacher_topk_logp), with_tail(student_topk_logp), beta)


def combine(reward_adv: torch.Tensor, distill_adv: torch.Tensor, coef: float, reward_weight: float) -> torch.Tensor:
    """(N, T) the advantage the loss gets: ``reward_weight * reward_adv + coef * distill_adv``
    (``reward_weight`` 0: the reward's advantage does not enter, not even as NaN or inf)."""
    out = coef * distill_adv
    return out + reward_weight * reward_adv if reward_weight else out


def distill_sums(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """This rank's sums for the ``distill/*`` metrics (the caller adds them over ranks)."""
    return {"tokens": float(mask.sum()), "kl": float(((student_logp - teacher_logp) * mask).sum()),
            "teacher": float((teacher_logp * mask).sum()), "student": float((student_logp * mask).sum())}
