"""Rollout correction: importance weights and rejection of samples whose rollout (vLLM) and
trainer probabilities disagree. Pure tensor math on this rank's (N, T) matrices; the trainer sums
the returned statistics over ranks.

With rho_t = pi_old(y_t) / pi_rollout(y_t) (the trainer's pre-update probability over vLLM's
sampling probability; log rho = old_logp - rollout_logp, clamped to +-20 before any exp):

- importance weights (``is_level``): ``token`` w_t = rho_t; ``sequence`` w = prod_t rho_t (one
  weight per sequence, unbiased, high variance); ``geometric`` w = exp(mean_t log rho_t) (the
  sequence's geometric mean, length-independent). ``is_mode: truncate`` (TIS) uses min(w, high);
  ``mask`` (MIS / IcePop) keeps w where low <= w <= high and gives the token (or sequence) weight
  0 otherwise.
- rejection (``rs``): a whole sequence (``seq_*``) or token (``token_*``) is dropped when its
  divergence passes the threshold: k1 = -log rho (bounds on rho itself: low <= exp(agg log rho)
  <= high), k2 = (log rho)^2 / 2, k3 = rho - 1 - log rho (an upper bound on the aggregate), the
  aggregate being the token's own value, the sequence's sum, mean or max (max: k2 and k3 only).

The normaliser. Rejected tokens leave the loss *and its normaliser* (``keep`` shrinks), as in
verl's ``compute_rollout_rejection_mask`` (it returns response_mask * the rejection mask). Tokens
that ``mask`` puts outside the band only get weight 0 and stay in the normaliser
(``is_mask_normalizer: all``, the default): IcePop's objective (Ling Team, "Every Step Evolves",
arXiv:2510.18855) averages over all response tokens, the masked ones contributing 0, and verl 0.9.1's
``compute_rollout_correction_weights`` (verl/trainer/ppo/rollout_corr_helper.py, its IcePop branch
for a "lower_upper" threshold) zeroes the weight with ``torch.where(token_kept_mask, weights, 0)``
and leaves the response mask alone. ``is_mask_normalizer: kept`` also removes them from the
normaliser (this module's behaviour before; a larger per-token step when many tokens are masked).
Weights are detached: they change the measure, not the objective.

Batch normalisation (``is_batch_normalize``, verl's ``rollout_is_batch_normalize``: self-normalised
importance sampling) divides the weights by their mean over the step's whole batch, every rank's
samples together, so they average 1: at token level the mean over every response token, at
sequence (and geometric) level the mean of the sequences' weights; computed after truncation or
masking, over the response mask before rejection, and only when that mean is > 1e-8, as verl
1dda039's compute_rollout_correction_weights does (verl/trainer/ppo/rollout_corr_helper.py:627-656).
The weight statistics (``is_weight_mean``, ``ess``) are the weights' before it, as verl's metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SAFETY_BOUND = 20.0  # exp(+-20): no overflow in fp32, and a bound no real weight reaches
IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("truncate", "mask")
IS_MASK_NORMALIZERS = ("all", "kept")  # is_mode mask: out-of-band tokens stay in the normaliser, or leave it
RS_MODES = tuple(f"token_k{k}" for k in (1, 2, 3)) + tuple(
    f"seq_{agg}_k{k}" for agg in ("sum", "mean") for k in (1, 2, 3)) + ("seq_max_k2", "seq_max_k3")


@dataclass
class Correction:
    """What the update applies: (N, T) loss weights (None = 1) and the mask of tokens still in the loss."""

    weights: torch.Tensor | None
    keep: torch.Tensor  # (N, T) 0/1, response mask times what rejection left (and MIS, with normaliser "kept")


def _seq(x: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """Per-sequence sum, mean or max of x over the masked tokens, (N, 1)."""
    m = mask.to(x.dtype)
    if how == "sum":
        return (x * m).sum(-1, keepdim=True)
    if how == "mean":
        return (x * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
    return x.masked_fill(m == 0, float("-inf")).amax(-1, keepdim=True).clamp(min=0)  # an empty row: 0


def log_weights(log_rho: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """log w at each position, (N, T): per token, or the sequence's sum / mean broadcast."""
    if level == "token":
        return log_rho
    if level not in IS_LEVELS:
        raise ValueError(f"unknown is_level {level!r}; valid: {', '.join(IS_LEVELS)}")
    return _seq(log_rho, mask, "sum" if level == "sequence" else "mean").expand_as(log_rho)


def importance(log_rho: torch.Tensor, mask: torch.Tensor, level: str, mode: str, low: float, high: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, in_band), both (N, T): TIS weights min(w, high) with everything in band, or MIS
    weights w * in_band with in_band = low <= w <= high (tested in log space: no overflow decides it)."""
    lw = log_weights(log_rho, mask, level).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    w = torch.exp(lw)
    if mode == "truncate":
        return w.clamp(max=high), torch.ones_like(w)
    if mode != "mask":
        raise ValueError(f"unknown is_mode {mode!r}; valid: {', '.join(IS_MODES)}")
    keep = ((lw >= torch.log(torch.tensor(low))) & (lw <= torch.log(torch.tensor(high)))).to(w.dtype)
    return w * keep, keep


def token_divergence(log_rho: torch.Tensor, k: str) -> torch.Tensor:
    lr = log_rho.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": torch.exp(lr) - 1.0 - lr}[k]


def rejection(log_rho: torch.Tensor, mask: torch.Tensor, mode: str, threshold: float, low: float | None
              ) -> torch.Tensor:
    """keep (N, T): 0 where ``mode`` rejects (the token, or its whole sequence)."""
    if mode not in RS_MODES:
        raise ValueError(f"unknown rs {mode!r}; valid: {', '.join(RS_MODES)}")
    scope, k = mode.rsplit("_k", 1)
    k = "k" + k
    if k == "k1":  # bounds on the ratio: low <= exp(aggregate log rho) <= high
        agg = log_rho if scope == "token" else _seq(log_rho, mask, scope.split("_")[1])
        lo = torch.log(torch.tensor(low if low is not None else 1.0 / threshold))
        ok = (agg >= lo) & (agg <= torch.log(torch.tensor(threshold)))
    else:
        d = token_divergence(log_rho, k)
        agg = d if scope == "token" else _seq(d, mask, scope.split("_")[1])
        ok = agg <= threshold
    return ok.expand_as(log_rho).to(log_rho.dtype)


def diagnostics(log_rho: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Sums over this rank's tokens / sequences of the off-policy estimates (the caller divides
    by the global counts): KL(rollout || trainer) by k1 (mean of -log rho) and k3, the token and
    sequence chi-squared divergences E[rho^2] - 1, E[prod rho^2] - 1."""
    m = mask.to(log_rho.dtype)
    lr = log_rho.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    seq_lr = (lr * m).sum(-1).clamp(-SAFETY_BOUND / 2, SAFETY_BOUND / 2)  # rho^2 of a sequence: exp(2 x)
    has = (m.sum(-1) > 0).to(lr.dtype)
    return {"kl_k1": (-lr * m).sum().item(), "kl_k3": (token_divergence(lr, "k3") * m).sum().item(),
            "chi2_token": ((torch.exp(2 * lr) - 1) * m).sum().item(),
            "chi2_seq": ((torch.exp(2 * seq_lr) - 1) * has).sum().item()}


def weight_stats(weights: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
    """Sums for the weights' mean and effective sample size (sum w)^2 / (n sum w^2) over the kept tokens."""
    k = keep.to(weights.dtype)
    return {"w": (weights * k).sum().item(), "w2": (weights ** 2 * k).sum().item(), "n_kept": k.sum().item()}


def correct(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, *, is_level: str | None,
            is_mode: str, is_low: float, is_high: float, rs: str | None, rs_threshold: float | None,
            rs_low: float | None, is_mask_normalizer: str = "all", is_batch_normalize: bool = False
            ) -> tuple[Correction, dict[str, float]]:
    """The correction of this rank's samples and the sums its metrics need (see ``summarise``).
    ``is_mask_normalizer`` (is_mode mask): "all" keeps out-of-band tokens in ``keep`` (weight 0,
    still counted by the normaliser: IcePop, verl), "kept" drops them from ``keep`` too.
    ``is_batch_normalize``: the sums of ``batch_normalize`` too; the caller applies it once every
    rank's sums are added up."""
    if is_mask_normalizer not in IS_MASK_NORMALIZERS:
        raise ValueError(f"unknown is_mask_normalizer {is_mask_normalizer!r}; valid: {', '.join(IS_MASK_NORMALIZERS)}")
    mask = mask.to(old_logp.dtype)
    log_rho = (old_logp.detach() - rollout_logp) * mask  # (N, T)
    keep = mask.clone()
    sums = {"tokens": mask.sum().item(), "seqs": float((mask.sum(-1) > 0).sum())}
    if rs is not None:
        ok = rejection(log_rho, mask, rs, rs_threshold, rs_low) * mask
        sums["rs_tokens"] = (mask - ok).sum().item()
        sums["rs_seqs"] = float(((mask - ok).sum(-1) > 0).sum())
        keep = keep * ok
    weights = None
    if is_level is not None:
        weights, in_band = importance(log_rho, mask, is_level, is_mode, is_low, is_high)
        sums["is_masked"] = (keep * (1 - in_band)).sum().item()
        kept = keep * in_band  # the weight statistics: over the tokens whose weight counts
        sums.update(weight_stats(weights, kept))
        sums["w_max"] = (weights * kept).max().item() if kept.any() else 0.0
        if is_batch_normalize:
            sums.update(_norm_sums(weights, mask, is_level))
        if is_mask_normalizer == "kept":
            keep = kept
    sums.update(diagnostics(log_rho, mask))
    return Correction(weights.detach() if weights is not None else None, keep), sums


def _norm_sums(weights: torch.Tensor, mask: torch.Tensor, level: str) -> dict[str, float]:
    """This rank's share of the batch mean of the weights: token level over the response tokens
    (the mask before rejection); otherwise over the sequences, each its weight (the masked mean of
    its tokens', all equal) once: verl's rollout_corr_helper.py:631-646."""
    if level == "token":
        return {"norm_w": (weights * mask).sum().item(), "norm_n": mask.sum().item()}
    has = (mask.sum(-1) > 0).to(weights.dtype)  # (N,)
    seq = (weights * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # (N,)
    return {"norm_w": (seq * has).sum().item(), "norm_n": has.sum().item()}


def batch_normalize(corr: Correction, total: dict[str, float]) -> dict[str, float]:
    """Divide ``corr.weights`` by the batch mean of the weights (``total``: every rank's sums), when
    it is > 1e-8 (verl: rollout_corr_helper.py:648-654); the factor as a metric. Nothing when the
    sums hold no batch mean (is_batch_normalize off)."""
    if "norm_n" not in total or corr.weights is None:
        return {}
    mean = total["norm_w"] / max(total["norm_n"], 1e-8)
    if mean <= 1e-8:
        return {"rollout_corr/is_batch_norm_factor": 1.0}
    corr.weights = corr.weights / mean
    return {"rollout_corr/is_batch_norm_factor": mean}


def summarise(total: dict[str, float], w_max: float | None) -> dict[str, float]:
    """Metrics from the sums of every rank (``total``) and the global largest weight."""
    tokens, seqs = max(total["tokens"], 1.0), max(total["seqs"], 1.0)
    out = {f"rollout_corr/{k}": total[k] / tokens for k in ("kl_k1", "kl_k3", "chi2_token")}
    out["rollout_corr/chi2_seq"] = total["chi2_seq"] / seqs
    if "rs_tokens" in total:
        out["rollout_corr/rs_rejected_token_frac"] = total["rs_tokens"] / tokens
        out["rollout_corr/rs_rejected_seq_frac"] = total["rs_seqs"] / seqs
    if "w" in total:
        kept = max(total["n_kept"], 1.0)
        out["rollout_corr/is_weight_mean"] = total["w"] / kept
        out["rollout_corr/is_weight_max"] = w_max
        out["rollout_corr/is_masked_frac"] = total["is_masked"] / tokens
        out["rollout_corr/ess"] = total["w"] ** 2 / max(kept * total["w2"], 1e-30)  # in (0, 1]
    return out
