"""Advantage estimators, KL penalties, loss aggregation and policy losses for GRPO-style RL.

Pure tensor math: no torch.distributed, no config objects. Everything the trainer can pick by
name lives in a small registry (``name -> function``); an unknown name raises a ValueError that
lists the valid ones, so config validation can use ``ADV_ESTIMATORS``, ``POLICY_LOSSES``,
``KL_KINDS`` and ``AGG_MODES``.

Shapes: N sequences, T response positions. ``mask`` is (N, T) with 1 on real response tokens.
Each consecutive block of ``group_size`` sequences holds the samples of one prompt.
"""

from __future__ import annotations

from typing import Callable

import torch

_ADV_REGISTRY: dict[str, Callable] = {}
_KL_REGISTRY: dict[str, Callable] = {}
_AGG_REGISTRY: dict[str, Callable] = {}
_LOSS_REGISTRY: dict[str, Callable] = {}


def _register(registry: dict[str, Callable], *names: str) -> Callable:
    def decorator(fn: Callable) -> Callable:
        for name in names:
            registry[name] = fn
        return fn

    return decorator


def _lookup(registry: dict[str, Callable], what: str, name: str) -> Callable:
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; valid: {', '.join(sorted(registry))}")
    return registry[name]


# ----------------------------------------------------------------------------- helpers


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1; 0 when the mask is empty."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, sum_fn=None) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked positions, unbiased var; masked again.

    ``sum_fn`` (list of floats -> list of floats) sums the statistics over every part of the batch
    (the trainer passes an all-rank sum), so the whitening is that of the global batch whatever the
    number of ranks; None = this tensor is the whole batch.
    """
    sum_fn = sum_fn or (lambda values: values)
    mask = mask.to(x.dtype)
    count, total = sum_fn([mask.sum().item(), (x * mask).sum().item()])
    mean = total / max(count, 1.0)
    centered = (x - mean) * mask
    # Bessel's correction; a single valid token has no spread, and clamping keeps it finite (0).
    var = sum_fn([(centered**2).sum().item()])[0] / max(count - 1, 1.0)
    return centered * torch.rsqrt(torch.tensor(var + eps, dtype=x.dtype))


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N,) -> (N // group_size, group_size), refusing a batch that does not split into groups."""
    if group_size < 1 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}"
        )
    if not rewards.is_floating_point():
        rewards = rewards.float()
    return rewards.view(-1, group_size)


def _group_mean(groups: torch.Tensor) -> torch.Tensor:
    """Per-group mean broadcast to the group's members, (G, n); a group of one has baseline 0."""
    if groups.shape[1] == 1:
        return torch.zeros_like(groups)
    return groups.mean(dim=1, keepdim=True).expand_as(groups)


def overlong_penalty(
    response_lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float
) -> torch.Tensor:
    """DAPO soft overlong punishment, (N,): a linear ramp from 0 at max_len - buffer_len down to
    -factor at max_len, so truncation is discouraged before it happens."""
    if buffer_len <= 0:
        raise ValueError(f"overlong buffer_len must be > 0, got {buffer_len}")
    start = max_len - buffer_len
    over = response_lengths.to(torch.float32) - start  # (N,)
    return torch.where(over > 0, -over / buffer_len * factor, torch.zeros_like(over))


def group_is_degenerate(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N // group_size,) bool: True where every reward of a group is equal. Such a group has
    zero advantage everywhere, hence no gradient; DAPO dynamic sampling drops it."""
    groups = _grouped(rewards, group_size)  # (G, n)
    return (groups == groups[:, :1]).all(dim=1)


# ----------------------------------------------------------------------------- advantages


@_register(_ADV_REGISTRY, "grpo")
def _adv_grpo(rewards, mask, group_size, *, epsilon: float = 1e-6, norm_by_std: bool = True, **_):
    groups = _grouped(rewards, group_size)  # (G, n)
    centered = groups - _group_mean(groups)
    if norm_by_std:  # norm_by_std=False is Dr.GRPO, which drops the std's difficulty bias
        if group_size == 1:
            std = torch.ones_like(groups)
        else:
            std = groups.std(dim=1, keepdim=True)  # unbiased (n - 1)
        centered = centered / (std + epsilon)
    return centered.reshape(-1, 1) * mask.to(centered.dtype)  # (N, T)


@_register(_ADV_REGISTRY, "rloo")
def _adv_rloo(rewards, mask, group_size, **_):
    groups = _grouped(rewards, group_size)  # (G, n)
    n = group_size
    if n > 1:
        # r - mean(others) == (r - mean) * n / (n - 1): the leave-one-out baseline, vectorised.
        groups = groups * n / (n - 1) - groups.mean(dim=1, keepdim=True) * n / (n - 1)
    return groups.reshape(-1, 1) * mask.to(groups.dtype)  # (N, T)


@_register(_ADV_REGISTRY, "reinforce_pp_baseline")
def _adv_reinforce_pp_baseline(rewards, mask, group_size, *, sum_fn=None, **_):
    groups = _grouped(rewards, group_size)  # (G, n)
    centered = (groups - _group_mean(groups)).reshape(-1, 1)  # (N, 1)
    mask = mask.to(centered.dtype)
    return masked_whiten(centered * mask, mask, sum_fn=sum_fn) * mask  # (N, T)


@_register(_ADV_REGISTRY, "reinforce_pp")
def _adv_reinforce_pp(rewards, mask, group_size, *, gamma: float = 1.0, sum_fn=None, **_):
    scores = _grouped(rewards, group_size).reshape(-1, 1)  # (N, 1)
    mask = mask.to(scores.dtype)
    # The reward sits on the last valid token, so a token's return is gamma^k * r, k = number of
    # valid tokens after it. Discounting counts valid tokens only: a masked gap inside the
    # response (e.g. tool output) is not an action step. Closed form avoids a Python loop over T.
    after = mask.sum(dim=1, keepdim=True) - mask.cumsum(dim=1)  # (N, T)
    returns = scores * torch.pow(gamma, after) * mask  # (N, T)
    return masked_whiten(returns, mask, sum_fn=sum_fn) * mask


@_register(_ADV_REGISTRY, "gpg")
def _adv_gpg(rewards, mask, group_size, *, sum_fn=None, **_):
    """GPG (Chu et al. 2025; verl's compute_gpg_outcome_advantage): r - group mean, scaled by
    alpha = N / (number of non-zero rewards), counted over the whole batch (all ranks)."""
    sum_fn = sum_fn or (lambda values: values)
    groups = _grouped(rewards, group_size)  # (G, n)
    count, nonzero = sum_fn([float(groups.numel()), float(torch.count_nonzero(groups))])
    alpha = count / max(nonzero, 1.0)
    centered = (groups - _group_mean(groups)) * alpha
    return centered.reshape(-1, 1) * mask.to(centered.dtype)  # (N, T)


@torch.no_grad()
def compute_advantages(
    name: str, rewards: torch.Tensor, mask: torch.Tensor, group_size: int, **options
) -> torch.Tensor:
    """Token-level advantages (N, T) from per-sequence rewards (N,); zero where mask is 0.

    Options an estimator does not use are ignored, so the trainer can pass one dict to all.
    """
    fn = _lookup(_ADV_REGISTRY, "adv_estimator", name)
    return fn(rewards, mask, group_size, **options)


# ----------------------------------------------------------------------------- KL penalty


@_register(_KL_REGISTRY, "k1")
def _kl_k1(logp, ref_logp):
    return logp - ref_logp


@_register(_KL_REGISTRY, "abs")
def _kl_abs(logp, ref_logp):
    return (logp - ref_logp).abs()


@_register(_KL_REGISTRY, "k2")
def _kl_k2(logp, ref_logp):
    return 0.5 * (logp - ref_logp).square()


@_register(_KL_REGISTRY, "k3", "low_var_kl")
def _kl_k3(logp, ref_logp):
    # Schulman's unbiased, always non-negative estimator; the clamps keep exp() from blowing up
    # when the policy drifts far from the reference on a rare token.
    d = (ref_logp - logp).clamp(-20, 20)
    return (d.exp() - d - 1).clamp(-10, 10)


def _straight_through(base: Callable) -> Callable:
    """``kind+``: the value of ``kind`` with the gradient of k2 (verl's kl_penalty, core_algos.py
    2187-2212): k1 and k3 estimate the KL's value without bias but not its gradient; k2's gradient
    is the KL's expected gradient."""
    def fn(logp, ref_logp):
        k2 = _kl_k2(logp, ref_logp)
        return k2 - k2.detach() + base(logp, ref_logp).detach()
    return fn


for _name in ("k1", "abs", "k3", "low_var_kl"):
    _KL_REGISTRY[_name + "+"] = _straight_through(_KL_REGISTRY[_name])
_KL_REGISTRY["k2+"] = _kl_k2  # k2's own gradient already


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate (N, T) between the policy and the reference; ``kind+`` takes its
    gradient from k2 (straight-through)."""
    return _lookup(_KL_REGISTRY, "kl kind", kind)(logp, ref_logp)


# ----------------------------------------------------------------------------- aggregation


def _denominator(global_count, local_count: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    count = local_count if global_count is None else torch.as_tensor(global_count)
    return count.to(like.device, like.dtype).clamp(min=1)


def _seq_mean(seq_values: torch.Tensor, mask: torch.Tensor, global_seqs, dp_size) -> torch.Tensor:
    has_tokens = mask.sum(dim=-1) > 0  # (N,) all-padding rows are not sequences
    total = (seq_values * has_tokens).sum()
    return total / _denominator(global_seqs, has_tokens.sum(), total) * dp_size


@_register(_AGG_REGISTRY, "token-mean")
def _agg_token_mean(loss_mat, mask, global_tokens, global_seqs, dp_size, norm_len):
    total = (loss_mat * mask).sum()
    return total / _denominator(global_tokens, mask.sum(), total) * dp_size


@_register(_AGG_REGISTRY, "token-sum")
def _agg_token_sum(loss_mat, mask, global_tokens, global_seqs, dp_size, norm_len):
    # verl's agg_loss token-sum (core_algos.py:1176-1180): the sum over every valid token of the
    # mini-batch; x dp_size because FSDP averages the ranks' gradients.
    return (loss_mat * mask).sum() * dp_size


@_register(_AGG_REGISTRY, "seq-mean-token-sum")
def _agg_seq_sum(loss_mat, mask, global_tokens, global_seqs, dp_size, norm_len):
    seq_sums = (loss_mat * mask).sum(dim=-1)  # (N,)
    return _seq_mean(seq_sums, mask, global_seqs, dp_size)


@_register(_AGG_REGISTRY, "seq-mean-token-mean")
def _agg_seq_mean(loss_mat, mask, global_tokens, global_seqs, dp_size, norm_len):
    seq_means = (loss_mat * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)  # (N,)
    return _seq_mean(seq_means, mask, global_seqs, dp_size)


@_register(_AGG_REGISTRY, "seq-mean-token-sum-norm")
def _agg_seq_sum_norm(loss_mat, mask, global_tokens, global_seqs, dp_size, norm_len):
    # Dr.GRPO: a constant length normaliser, so long responses are not down-weighted per token.
    norm = loss_mat.shape[-1] if norm_len is None else norm_len
    return _agg_seq_sum(loss_mat, mask, global_tokens, global_seqs, dp_size, None) / norm


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_tokens=None,
    global_seqs=None,
    dp_size: int = 1,
    norm_len=None,
    copies: int = 1,
) -> torch.Tensor:
    """Reduce a (N, T) loss to a scalar.

    ``global_tokens``/``global_seqs`` are the counts over the whole mini-batch (all micro-batches,
    all ranks). With them, summing micro-batch gradients and letting FSDP average across
    ``dp_size`` ranks (hence the ``* dp_size``) reproduces the gradient of the global loss.
    Without them the local counts are used. ``norm_len`` defaults to T, which differs between
    micro-batches padded to different lengths: pass it explicitly when micro-batching.
    ``copies``: how many ranks hold each sample (U under Ulysses, rlcore.algo.grpo.sp_group_batch):
    the all-rank counts and ``dp_size`` both count each sample that many times, which cancels in
    the means but not in token-sum's bare ``x dp_size``, so both are divided by it.
    """
    fn = _lookup(_AGG_REGISTRY, "loss_agg_mode", mode)
    mask = mask.to(loss_mat.dtype)
    if copies != 1:
        global_tokens = None if global_tokens is None else global_tokens / copies
        global_seqs = None if global_seqs is None else global_seqs / copies
        dp_size = dp_size / copies
    return fn(loss_mat, mask, global_tokens, global_seqs, dp_size, norm_len)


# ----------------------------------------------------------------------------- policy losses


@_register(_LOSS_REGISTRY, "vanilla")
def _loss_vanilla(logp, old_logp, adv, mask, clip_low, clip_high, dual_clip_c, **_):
    """PPO clip (DAPO clip-higher when clip_high > clip_low) with dual clip for A < 0."""
    if dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    log_ratio = logp - old_logp  # (N, T)
    ratio = torch.exp(log_ratio.clamp(-20, 20))  # clamp: exp overflow would give inf * 0 = nan grads
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(l1, l2)
    # Dual clip: with A < 0 and a huge ratio the PPO loss is unbounded; cap it at -A * c.
    l3 = -adv * dual_clip_c
    negative = adv < 0
    loss = torch.where(negative, torch.minimum(clipped, l3), clipped)
    metrics = {
        "actor/clip_frac": masked_mean((l2 > l1).float(), mask).item(),
        "actor/ppo_kl": masked_mean(-log_ratio, mask).item(),
        "actor/clip_frac_lower": masked_mean(((clipped > l3) & negative).float(), mask).item(),
    }
    return loss, metrics


@_register(_LOSS_REGISTRY, "gspo")
def _loss_gspo(logp, old_logp, adv, mask, clip_low, clip_high, dual_clip_c, **_):
    """GSPO: one importance ratio per sequence (geometric mean of token ratios), clipped as a
    whole, so a few outlier tokens cannot dominate a long sequence's update."""
    log_ratio = logp - old_logp  # (N, T)
    m = mask.to(log_ratio.dtype)
    seq_log_ratio = (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
    # Value is s_i on every token, but each token's gradient is s_i * d logp_t (stop-gradient
    # trick), rather than s_i / |y_i| * d logp_t from differentiating the sequence mean.
    token_log_ratio = logp - logp.detach() + seq_log_ratio.detach()  # (N, T)
    ratio = torch.exp(token_log_ratio.clamp(max=10.0))
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(l1, l2)
    metrics = {
        "actor/clip_frac": masked_mean((l2 > l1).float(), mask).item(),
        "actor/ppo_kl": masked_mean(-log_ratio, mask).item(),
        "actor/clip_frac_lower": 0.0,
    }
    return loss, metrics


# verl's other policy losses (verl/trainer/ppo/core_algos.py at 1dda039; tests/test_loss_modes.py
# checks each against verl's own function). Each returns the (N, T) loss before aggregation.


def _ratio(logp, old_logp):
    log_ratio = (logp - old_logp).clamp(-20, 20)  # (N, T)
    return log_ratio, torch.exp(log_ratio)


@_register(_LOSS_REGISTRY, "gpg")
def _loss_gpg(logp, old_logp, adv, mask, clip_low, clip_high, dual_clip_c, **_):
    """GPG (compute_policy_loss_gpg): plain policy gradient -A log p, no ratio, no clip."""
    return -logp * adv, {"actor/ppo_kl": masked_mean(old_logp - logp, mask).item(), "actor/clip_frac": 0.0,
                         "actor/clip_frac_lower": 0.0}


@_register(_LOSS_REGISTRY, "cispo")
def _loss_cispo(logp, old_logp, adv, mask, clip_low, clip_high, dual_clip_c, **_):
    """CISPO (MiniMax-M1; compute_policy_loss_cispo): -sg(clip(ratio)) A log p, so every token
    keeps a gradient; the clip bounds its weight only."""
    log_ratio, ratio = _ratio(logp, old_logp)
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    metrics = {"actor/clip_frac": masked_mean((ratio != clipped).float(), mask).item(),
               "actor/ppo_kl": masked_mean(-log_ratio, mask).item(), "actor/clip_frac_lower": 0.0}
    return -clipped.detach() * adv * logp, metrics


@_register(_LOSS_REGISTRY, "sapo")
def _loss_sapo(logp, old_logp, adv, mask, clip_low, clip_high, dual_clip_c, *, tau_pos=1.0, tau_neg=1.05, **_):
    """SAPO (compute_policy_loss_sapo): a smooth gate sigmoid(tau (r - 1)) 4 / tau instead of the
    clip, tau_pos for A > 0 and tau_neg otherwise."""
    log_ratio, ratio = _ratio(logp, old_logp)
    tau = torch.where(adv > 0, torch.as_tensor(tau_pos, dtype=adv.dtype), torch.as_tensor(tau_neg, dtype=adv.dtype))
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return -gates * adv, {"actor/ppo_kl": masked_mean(-log_ratio, mask).item(), "actor/clip_frac": 0.0,
                          "actor/clip_frac_lower": 0.0}


@_register(_LOSS_REGISTRY, "geo_mean")
def _loss_geo_mean(logp, old_logp, adv, mask, clip_low, clip_high, dual_clip_c, **_):
    """GMPO (compute_policy_loss_geo_mean): the geometric mean of the token ratios, each clipped
    in log space by the advantage's sign, times the sequence's mean advantage; one loss per
    sequence, set on each of its tokens (aggregate with seq-mean-token-mean for verl's mean over
    sequences)."""
    m = mask.to(logp.dtype)
    log_ratio = logp - old_logp  # (N, T), unclamped as in verl
    sign = torch.sign(adv)
    clamped = log_ratio.clamp(-clip_low, clip_high)
    kept = sign * torch.minimum(sign * log_ratio, sign * clamped)  # (N, T)
    length = m.sum(-1)  # (N,)
    ratio = torch.exp((kept * m).sum(-1) / (length + 1e-8))  # (N,)
    seq_adv = (adv * m).sum(-1) / (length + 1e-8)  # (N,)
    clipped = log_ratio != clamped
    metrics = {"actor/clip_frac": masked_mean((clipped & (adv > 0)).float(), mask).item(),
               "actor/clip_frac_lower": masked_mean((clipped & (adv < 0)).float(), mask).item(),
               "actor/ppo_kl": masked_mean(-log_ratio, mask).item()}
    return (-seq_adv * ratio).unsqueeze(-1).expand_as(logp), metrics


def _dppo(logp, old_logp, adv, mask, dual_clip_c, valid):
    log_ratio, ratio = _ratio(logp, old_logp)
    valid = valid.detach().to(logp.dtype)
    truncated = ratio.clamp(max=dual_clip_c).detach()  # truncated IS instead of the dual clip
    metrics = {"actor/clip_frac": masked_mean(1.0 - valid, mask).item(),
               "actor/clip_frac_lower": masked_mean((ratio > dual_clip_c).to(logp.dtype) * valid, mask).item(),
               "actor/ppo_kl": masked_mean(-log_ratio, mask).item()}
    return -adv * truncated * logp * valid, metrics


@_register(_LOSS_REGISTRY, "dppo_tv")
def _loss_dppo_tv(logp, old_logp, adv, mask, clip_low, clip_high, dual_clip_c, **_):
    """DPPO-Binary-TV (compute_policy_loss_dppo_tv): tokens whose probability moved by more than
    clip_high up (A > 0) or clip_low down (A <= 0) get no gradient; dual_clip_c caps the ratio."""
    moved = torch.exp(logp) - torch.exp(old_logp)
    return _dppo(logp, old_logp, adv, mask, dual_clip_c, torch.where(adv > 0, moved <= clip_high, moved >= -clip_low))


@_register(_LOSS_REGISTRY, "dppo_kl")
def _loss_dppo_kl(logp, old_logp, adv, mask, clip_low, clip_high, dual_clip_c, **_):
    """DPPO-Binary-KL (compute_policy_loss_dppo_kl): as dppo_tv with the binary KL of the token's
    probability as the divergence."""
    p, q = torch.exp(logp), torch.exp(old_logp)
    kl = q * (old_logp - logp) + (1 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
    valid = torch.where(adv > 0, (kl <= clip_high) | (p <= q), (kl <= clip_low) | (p >= q))
    return _dppo(logp, old_logp, adv, mask, dual_clip_c, valid)


# Losses whose aggregation is part of their definition (verl: core_algos.py:1687-1689 sapo, :1991
# geo_mean's mean over sequences).
_OWN_AGGREGATION = {"sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-mean"}


def clip_cov_weights(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *,
                     ratio: float, low: float, high: float, clip_low: float, clip_high: float,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, int]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models"; verl's compute_policy_loss_clip_cov): a (N, T) 0/1 weight that removes the
    gradient of max(1, int(ratio * tokens)) tokens drawn at random among the masked tokens whose
    centred covariance (A - mean A) * (logp - mean logp) lies strictly inside (low, high) and
    that the PPO clip has not clipped already. Those high-covariance tokens are the ones whose
    update lowers the entropy most. Returns the weights (detached) and how many were dropped."""
    m = mask.bool()
    lp = logp.detach()
    r = torch.exp((lp - old_logp).clamp(-20, 20))
    clipped = (-adv * r.clamp(1 - clip_low, 1 + clip_high)) > (-adv * r)
    cov = (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp, mask))  # (N, T)
    candidates = torch.nonzero(m & ~clipped & (cov > low) & (cov < high))  # (K, 2)
    weights = torch.ones_like(lp)
    count = min(max(int(ratio * m.sum().item()), 1), len(candidates))
    if count:
        pick = candidates[torch.randperm(len(candidates), generator=generator)[:count].to(candidates.device)]
        weights[pick[:, 0], pick[:, 1]] = 0.0
    return weights, count


def policy_loss(
    name: str,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float = 3.0,
    agg_mode: str = "token-mean",
    is_weights: torch.Tensor | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    **agg_kwargs,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss, aggregated by ``agg_mode``; returns (loss, metrics).

    ``is_weights`` (N, T), e.g. truncated importance weights correcting rollout/trainer mismatch,
    multiply the per-token loss (geo_mean, a loss per sequence: their geometric mean over the
    sequence, as verl). sapo and geo_mean aggregate as verl's do, by seq-mean-token-mean whatever
    ``agg_mode`` says (the entropy and KL terms still follow it). ``tau_pos``/``tau_neg``: sapo's
    gate temperatures. ``agg_kwargs`` go to :func:`aggregate_loss`. Metrics are local masked means.
    """
    fn = _lookup(_LOSS_REGISTRY, "policy_loss", name)
    _lookup(_AGG_REGISTRY, "loss_agg_mode", agg_mode)  # fail before doing any work
    agg_mode = _OWN_AGGREGATION.get(name, agg_mode)
    loss_mat, metrics = fn(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip_c,
                           tau_pos=tau_pos, tau_neg=tau_neg)
    if is_weights is not None and name == "geo_mean":
        m = mask.to(loss_mat.dtype)
        seq = torch.exp((torch.log(is_weights + 1e-10) * m).sum(-1) / (m.sum(-1) + 1e-8))  # (N,)
        loss_mat = loss_mat * seq.unsqueeze(-1)
    elif is_weights is not None:
        loss_mat = loss_mat * is_weights
    loss = aggregate_loss(loss_mat, mask, agg_mode, **agg_kwargs)
    return loss, metrics


ADV_ESTIMATORS: tuple[str, ...] = tuple(sorted(_ADV_REGISTRY))
KL_KINDS: tuple[str, ...] = tuple(sorted(_KL_REGISTRY))
AGG_MODES: tuple[str, ...] = tuple(sorted(_AGG_REGISTRY))
POLICY_LOSSES: tuple[str, ...] = tuple(sorted(_LOSS_REGISTRY))
