"""verl's loss modes, KL estimators and aggregations in rlcore/advantage.py against verl's own
functions (tests/verl_reference.py, copied from verl 1dda039): the loss and its gradient on random
batches, within 1e-6 (float64; verl's 1e-8 in some denominators is the only difference)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import verl_reference as verl
from rlcore import advantage

pytestmark = pytest.mark.unit

F64 = torch.float64
TOL = 1e-6


def batch(seed: int, n: int = 6, t: int = 9):
    """Random log-probs near each other (ratios around 1, some clipped), token advantages of a
    sequence-level reward, and a right-padded mask with every row non-empty."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g, dtype=F64) * 3
    logp = old + torch.randn(n, t, generator=g, dtype=F64) * 0.3
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(F64)  # (N, T)
    adv = torch.randn(n, 1, generator=g, dtype=F64).expand(n, t) * mask
    return logp, old, adv, mask


def close(a, b, what):
    torch.testing.assert_close(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64), rtol=TOL, atol=TOL,
                               msg=lambda m: f"{what}: {m}")


def value_and_grad(fn, logp):
    x = logp.clone().requires_grad_(True)
    loss = fn(x)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad


def verl_config(mode: str, clip_low: float, clip_high: float, clip_c: float, **extra):
    return verl.ActorConfig(clip_ratio=0.2, clip_ratio_low=clip_low, clip_ratio_high=clip_high, clip_ratio_c=clip_c,
                            tau_pos=extra.get("tau_pos", 1.0), tau_neg=extra.get("tau_neg", 1.05),
                            global_batch_info={}, policy_loss=verl.ActorConfig(loss_mode=mode))


VERL_LOSSES = {"vanilla": verl.compute_policy_loss_vanilla, "gspo": verl.compute_policy_loss_gspo,
               "sapo": verl.compute_policy_loss_sapo, "gpg": verl.compute_policy_loss_gpg,
               "geo_mean": verl.compute_policy_loss_geo_mean, "cispo": verl.compute_policy_loss_cispo,
               "dppo_tv": verl.compute_policy_loss_dppo_tv, "dppo_kl": verl.compute_policy_loss_dppo_kl}
# verl's gspo aggregates by seq-mean-token-mean whatever loss_agg_mode says: here it follows
# algorithm.loss_agg_mode, which the converter sets to that (sapo and geo_mean aggregate as verl's
# whatever the mode, so every mode is compared)
FIXED_AGG = {"gspo": "seq-mean-token-mean"}


AGGS = ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum"]


@pytest.mark.parametrize("mode, agg", [(m, a) for m in sorted(VERL_LOSSES) for a in AGGS
                                       if m not in FIXED_AGG or a == FIXED_AGG[m]])
def test_policy_losses_match_verls(mode, agg):
    clip_low, clip_high, clip_c = (0.2, 0.28, 3.0) if not mode.startswith("dppo") else (0.05, 0.08, 3.0)
    for seed in range(5):
        logp, old, adv, mask = batch(seed)
        cfg = verl_config(mode, clip_low, clip_high, clip_c, tau_pos=1.0, tau_neg=1.05)
        ours = value_and_grad(lambda x: advantage.policy_loss(
            mode, x, old, adv, mask, clip_low=clip_low, clip_high=clip_high, dual_clip_c=clip_c, agg_mode=agg,
            tau_pos=1.0, tau_neg=1.05)[0], logp)
        theirs = value_and_grad(lambda x: VERL_LOSSES[mode](old, x, adv, mask, loss_agg_mode=agg, config=cfg)[0], logp)
        close(ours[0], theirs[0], f"{mode} {agg} loss, seed {seed}")
        close(ours[1], theirs[1], f"{mode} {agg} gradient, seed {seed}")


@pytest.mark.parametrize("mode", ["vanilla", "cispo", "gpg", "geo_mean", "dppo_tv"])
def test_rollout_is_weights_apply_as_verls(mode):
    logp, old, adv, mask = batch(11)
    weights = torch.rand(logp.shape, generator=torch.Generator().manual_seed(3), dtype=F64) + 0.5
    agg = "token-mean"
    cfg = verl_config(mode, 0.2, 0.28, 3.0)
    ours = advantage.policy_loss(mode, logp, old, adv, mask, clip_low=0.2, clip_high=0.28, agg_mode=agg,
                                 is_weights=weights)[0]
    theirs = VERL_LOSSES[mode](old, logp, adv, mask, loss_agg_mode=agg, config=cfg, rollout_is_weights=weights)[0]
    close(ours, theirs, mode)


@pytest.mark.parametrize("kind", ["k3+", "low_var_kl+", "k1+", "abs+", "k2+", "k3", "low_var_kl", "k1", "abs", "k2"])
def test_kl_estimators_and_their_straight_through_gradients_match_verls(kind):
    for seed in range(5):
        logp, ref, _, mask = batch(seed)
        ours = value_and_grad(lambda x: (advantage.kl_penalty(x, ref, kind) * mask).sum(), logp)
        theirs = value_and_grad(lambda x: (verl.kl_penalty(x, ref, kind) * mask).sum(), logp)
        close(ours[0], theirs[0], f"{kind} value")
        close(ours[1], theirs[1], f"{kind} gradient")
    if kind.endswith("+") and kind != "k2+":  # the value is the plain estimator's, the gradient k2's
        logp, ref, _, mask = batch(7)
        plain = value_and_grad(lambda x: advantage.kl_penalty(x, ref, kind[:-1]).sum(), logp)
        k2 = value_and_grad(lambda x: advantage.kl_penalty(x, ref, "k2").sum(), logp)
        st = value_and_grad(lambda x: advantage.kl_penalty(x, ref, kind).sum(), logp)
        close(st[0], plain[0], "value of the plain estimator")
        close(st[1], k2[1], "gradient of k2")


@pytest.mark.parametrize("dp_size", [1, 4])
def test_token_sum_matches_verls_agg_loss(dp_size):
    for seed in range(5):
        logp, _, _, mask = batch(seed)
        loss = logp ** 2
        close(advantage.aggregate_loss(loss, mask, "token-sum", dp_size=dp_size),
              verl.agg_loss(loss, mask, "token-sum", dp_size=dp_size), f"token-sum dp {dp_size}")


def test_token_sum_over_micro_batches_and_ranks_sums_the_gradient():
    """Micro-batches and ranks each add their part; FSDP's average over ranks times dp_size gives
    the sum over the whole mini-batch, as one batch computes it."""
    logp, old, adv, mask = batch(21, n=8)
    full = value_and_grad(lambda x: advantage.policy_loss("vanilla", x, old, adv, mask, agg_mode="token-sum")[0], logp)
    grad = torch.zeros_like(logp)
    for rank in range(2):
        for micro in range(2):
            idx = list(range(rank * 4 + micro * 2, rank * 4 + micro * 2 + 2))
            part = value_and_grad(lambda x: advantage.policy_loss("vanilla", x, old[idx], adv[idx], mask[idx],
                                                                  agg_mode="token-sum", dp_size=2)[0], logp[idx])
            grad[idx] += part[1] / 2  # FSDP averages the two ranks' gradients
    close(grad, full[1], "token-sum gradient")


def test_gpg_advantage_matches_verls():
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        n, group, t = 12, 4, 7
        rewards = torch.randint(0, 3, (n,), generator=g).to(F64) * (torch.rand(n, generator=g, dtype=F64) > 0.3)
        lengths = torch.randint(1, t + 1, (n,), generator=g)
        mask = (torch.arange(t)[None, :] < lengths[:, None]).to(F64)
        token_rewards = torch.zeros(n, t, dtype=F64)
        token_rewards[torch.arange(n), lengths - 1] = rewards  # verl's reward on the last response token
        index = np.array([i // group for i in range(n)])
        theirs, _ = verl.compute_gpg_outcome_advantage(token_rewards, mask, index)
        ours = advantage.compute_advantages("gpg", rewards, mask, group)
        close(ours, theirs, f"gpg advantages, seed {seed}")


def test_gpg_counts_the_non_zero_rewards_of_every_rank():
    """The batch's count is global: two halves with a sum over both give the whole batch's alpha."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=F64)
    mask = torch.ones(8, 3, dtype=F64)
    whole = advantage.compute_advantages("gpg", rewards, mask, 2)
    totals = [8.0, 4.0]  # elements and non-zero rewards over both halves
    halves = [advantage.compute_advantages("gpg", rewards[k:k + 4], mask[k:k + 4], 2, sum_fn=lambda values: totals)
              for k in (0, 4)]
    close(torch.cat(halves), whole, "gpg over ranks")
    close(whole[0, 0], 2.0 * (1.0 - 0.5), "alpha = 8 / 4")
