"""Hand-computed checks for rlcore.advantage: every estimator, KL kind, aggregation mode and policy
loss on inputs small enough to do the arithmetic in the test itself."""

from __future__ import annotations

import math

import pytest
import torch

from rlcore.advantage import (
    ADV_ESTIMATORS,
    AGG_MODES,
    KL_KINDS,
    POLICY_LOSSES,
    aggregate_loss,
    compute_advantages,
    group_is_degenerate,
    kl_penalty,
    masked_mean,
    masked_whiten,
    overlong_penalty,
    policy_loss,
)

pytestmark = pytest.mark.unit  # pure logic: no torchrun, no vLLM, no model build

F64 = torch.float64
EPS = 1e-6


def t(x):
    return torch.tensor(x, dtype=F64)


def close(actual, expected, tol=1e-9):
    actual, expected = torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64)
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def whiten_by_hand(values):
    """Reference for the batch whitening: plain Python, unbiased variance, eps 1e-8."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


# ----------------------------------------------------------------------------- registries


def test_registries_list_the_valid_names():
    assert set(ADV_ESTIMATORS) == {"grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gpg"}
    plain = {"k1", "abs", "k2", "k3", "low_var_kl"}
    assert set(KL_KINDS) == plain | {k + "+" for k in plain}  # +: straight-through (test_loss_modes.py)
    assert set(AGG_MODES) == {
        "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    }
    assert set(POLICY_LOSSES) == {"vanilla", "gspo", "gpg", "cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl"}


@pytest.mark.parametrize(
    "call, what, valid",
    [
        (lambda: compute_advantages("foo", t([1.0]), t([[1.0]]), 1), "adv_estimator", ADV_ESTIMATORS),
        (lambda: kl_penalty(t([0.0]), t([0.0]), "foo"), "kl kind", KL_KINDS),
        (lambda: aggregate_loss(t([[1.0]]), t([[1.0]]), "foo"), "loss_agg_mode", AGG_MODES),
        (lambda: policy_loss("foo", t([[0.0]]), t([[0.0]]), t([[1.0]]), t([[1.0]])), "policy_loss",
         POLICY_LOSSES),
        (lambda: policy_loss("vanilla", t([[0.0]]), t([[0.0]]), t([[1.0]]), t([[1.0]]),
                             agg_mode="foo"), "loss_agg_mode", AGG_MODES),
    ],
)
def test_unknown_name_error_lists_valid_names(call, what, valid):
    with pytest.raises(ValueError) as err:
        call()
    msg = str(err.value)
    assert msg.startswith(f"unknown {what} 'foo'; valid: ")
    assert msg.endswith(", ".join(sorted(valid)))


def test_rewards_must_split_into_groups():
    with pytest.raises(ValueError, match="groups of 2"):
        compute_advantages("grpo", t([1.0, 2.0, 3.0]), torch.ones(3, 2, dtype=F64), 2)
    with pytest.raises(ValueError, match="groups of 2"):
        group_is_degenerate(t([1.0, 2.0, 3.0]), 2)


# ----------------------------------------------------------------------------- advantages


def test_grpo_unbiased_std_and_mask():
    rewards = t([1.0, 2.0, 4.0, 0.0, 3.0, 3.0])  # groups [1, 2, 4] and [0, 3, 3]
    mask = t([[1, 1], [1, 0], [0, 0], [1, 1], [1, 1], [1, 0]])
    adv = compute_advantages("grpo", rewards, mask, 3)
    m1, s1 = 7 / 3, math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2)  # n-1
    m2, s2 = 2.0, math.sqrt(((0 - 2) ** 2 + 1 + 1) / 2)  # sqrt(3)
    a = [(1 - m1) / (s1 + EPS), (2 - m1) / (s1 + EPS), (4 - m1) / (s1 + EPS),
         (0 - m2) / (s2 + EPS), (3 - m2) / (s2 + EPS), (3 - m2) / (s2 + EPS)]
    close(adv, [[a[0], a[0]], [a[1], 0], [0, 0], [a[3], a[3]], [a[4], a[4]], [a[5], 0]])


def test_grpo_options_dr_grpo_epsilon_and_ignored_options():
    rewards, mask = t([1.0, 0.0]), torch.ones(2, 1, dtype=F64)
    # Dr.GRPO: no std division.
    close(compute_advantages("grpo", rewards, mask, 2, norm_by_std=False), [[0.5], [-0.5]])
    # std of [1, 0] with n-1 is sqrt(0.5) = 0.7071; epsilon is configurable.
    close(compute_advantages("grpo", rewards, mask, 2, epsilon=0.5),
          [[0.5 / (math.sqrt(0.5) + 0.5)], [-0.5 / (math.sqrt(0.5) + 0.5)]])
    # Options for other estimators are accepted and ignored.
    close(compute_advantages("grpo", rewards, mask, 2, gamma=0.3),
          [[0.5 / (math.sqrt(0.5) + EPS)], [-0.5 / (math.sqrt(0.5) + EPS)]])


def test_grpo_group_of_one_uses_mean_0_std_1():
    rewards, mask = t([2.0, -1.0]), torch.ones(2, 1, dtype=F64)
    close(compute_advantages("grpo", rewards, mask, 1), [[2 / (1 + EPS)], [-1 / (1 + EPS)]])
    close(compute_advantages("grpo", rewards, mask, 1, norm_by_std=False), [[2.0], [-1.0]])


def test_grpo_equal_rewards_give_zero():
    close(compute_advantages("grpo", t([0.5, 0.5]), torch.ones(2, 2, dtype=F64), 2), [[0, 0], [0, 0]])


def test_rloo_leave_one_out_baseline():
    rewards = t([1.0, 2.0, 4.0, 0.0, 1.0, 5.0])
    mask = t([[1, 1], [1, 1], [1, 0], [1, 1], [0, 0], [1, 1]])
    adv = compute_advantages("rloo", rewards, mask, 3, norm_by_std=True, epsilon=9.0)
    a = [1 - (2 + 4) / 2, 2 - (1 + 4) / 2, 4 - (1 + 2) / 2,  # r_i - mean of the other two
         0 - (1 + 5) / 2, 1 - (0 + 5) / 2, 5 - (0 + 1) / 2]
    close(adv, [[a[0], a[0]], [a[1], a[1]], [a[2], 0], [a[3], a[3]], [0, 0], [a[5], a[5]]])


def test_rloo_group_of_one_keeps_reward():
    close(compute_advantages("rloo", t([3.0, -2.0]), t([[1, 0], [1, 1]]), 1), [[3, 0], [-2, -2]])


def test_reinforce_pp_baseline_group_centred_then_batch_whitened():
    rewards = t([1.0, 0.0, 3.0, 3.0])  # group means 0.5 and 3
    mask = t([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
    adv = compute_advantages("reinforce_pp_baseline", rewards, mask, 2, gamma=0.5)
    # Token values before whitening, row by row: 0.5 0.5 | -0.5 | 0 0 0 | 0  (7 tokens)
    w = whiten_by_hand([0.5, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0])
    close(adv, [[w[0], w[1], 0], [w[2], 0, 0], [w[3], w[4], w[5]], [w[6], 0, 0]])


def test_reinforce_pp_baseline_group_of_one_has_zero_baseline():
    rewards, mask = t([1.0, 3.0]), t([[1, 1], [1, 0]])
    w = whiten_by_hand([1.0, 1.0, 3.0])
    close(compute_advantages("reinforce_pp_baseline", rewards, mask, 1), [[w[0], w[1]], [w[2], 0]])


def test_reinforce_pp_discounted_returns_then_whitened():
    rewards = t([1.0, 2.0])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv = compute_advantages("reinforce_pp", rewards, mask, 2, gamma=0.5, norm_by_std=False)
    # Reward on the last valid token: row 0 returns 0.25 0.5 1, row 1 returns 1 2.
    w = whiten_by_hand([0.5**2 * 1, 0.5 * 1, 1.0, 0.5 * 2, 2.0])
    close(adv, [[w[0], w[1], w[2], 0], [w[3], w[4], 0, 0]])


def test_reinforce_pp_default_gamma_is_one_and_gaps_do_not_discount():
    rewards = t([1.0, 3.0])
    mask = t([[1, 1, 0, 0], [1, 0, 1, 1]])
    w = whiten_by_hand([1.0, 1.0, 3.0, 3.0, 3.0])  # gamma = 1: every valid token gets r
    close(compute_advantages("reinforce_pp", rewards, mask, 1), [[w[0], w[1], 0, 0],
                                                                [w[2], 0, w[3], w[4]]])
    # gamma = 0.5: the masked gap is not an action step, so it is not discounted.
    w = whiten_by_hand([0.5 * 1, 1.0, 0.5**2 * 3, 0.5 * 3, 3.0])
    close(compute_advantages("reinforce_pp", rewards, mask, 1, gamma=0.5),
          [[w[0], w[1], 0, 0], [w[2], 0, w[3], w[4]]])


@pytest.mark.parametrize("name", ADV_ESTIMATORS)
def test_advantages_zero_off_mask_and_no_grad(name):
    rewards = torch.tensor([1.0, 0.0, 2.0, 5.0], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.bool)
    adv = compute_advantages(name, rewards, mask, 2, epsilon=1e-6, norm_by_std=True, gamma=1.0)
    assert adv.shape == (4, 3) and not adv.requires_grad
    assert torch.all(adv[~mask] == 0) and torch.isfinite(adv).all()


# ----------------------------------------------------------------------------- KL


LOGP = t([[-1.0, -2.0, -1.0, 0.0]])
REF = t([[-1.5, -1.0, 2.0, -3.0]])  # ref - logp = -0.5, 1, 3, -3


def test_kl_k1_abs_k2():
    close(kl_penalty(LOGP, REF, "k1"), [[0.5, -1.0, -3.0, 3.0]])
    close(kl_penalty(LOGP, REF, "abs"), [[0.5, 1.0, 3.0, 3.0]])
    close(kl_penalty(LOGP, REF, "k2"), [[0.5 * 0.25, 0.5 * 1.0, 0.5 * 9.0, 0.5 * 9.0]])


@pytest.mark.parametrize("kind", ["k3", "low_var_kl"])
def test_kl_k3(kind):
    # d = ref - logp; exp(d) - d - 1, then clamped to [-10, 10]: exp(3) - 4 = 16.09 -> 10.
    expected = [math.exp(-0.5) + 0.5 - 1, math.exp(1) - 1 - 1, 10.0, math.exp(-3) + 3 - 1]
    close(kl_penalty(LOGP, REF, kind), [expected])


def test_kl_k3_clamps_d_so_huge_gaps_stay_finite():
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    kl = kl_penalty(logp, torch.tensor([[500.0, -500.0]]), "k3")
    close(kl.detach(), [[10.0, 10.0]])
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()


# ----------------------------------------------------------------------------- aggregation


LOSS = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # row 2 is padding: not a sequence


def test_agg_token_mean():
    close(aggregate_loss(LOSS, MASK, "token-mean"), (1 + 2 + 4) / 3)
    close(aggregate_loss(LOSS, MASK, "token-mean", global_tokens=7, dp_size=2), (1 + 2 + 4) / 7 * 2)


def test_agg_seq_mean_token_sum():
    close(aggregate_loss(LOSS, MASK, "seq-mean-token-sum"), ((1 + 2) + 4) / 2)
    close(aggregate_loss(LOSS, MASK, "seq-mean-token-sum", global_seqs=5, dp_size=2),
          ((1 + 2) + 4) / 5 * 2)


def test_agg_seq_mean_token_mean():
    close(aggregate_loss(LOSS, MASK, "seq-mean-token-mean"), ((1 + 2) / 2 + 4 / 1) / 2)
    close(aggregate_loss(LOSS, MASK, "seq-mean-token-mean", global_seqs=torch.tensor(4), dp_size=3),
          ((1 + 2) / 2 + 4 / 1) / 4 * 3)


def test_agg_seq_mean_token_sum_norm():
    close(aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm"), ((1 + 2) + 4) / 2 / 3)  # T = 3
    close(aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_len=10), ((1 + 2) + 4) / 2 / 10)
    close(aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_len=10, global_seqs=4,
                         dp_size=2), ((1 + 2) + 4) / 4 * 2 / 10)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_empty_mask_is_zero_not_nan(mode):
    loss = aggregate_loss(LOSS, torch.zeros(3, 3, dtype=F64), mode)
    close(loss, 0.0)
    close(aggregate_loss(LOSS, MASK, mode, global_tokens=0, global_seqs=0),
          aggregate_loss(LOSS, MASK, mode, global_tokens=1, global_seqs=1))


# ----------------------------------------------------------------------------- policy losses


# clip_low 0.2, clip_high 0.28 (clip-higher), dual_clip_c 3. Token by token (A, ratio):
#   (1, 1.5):  l1 = -1.5,  l2 = -1.28 -> -1.28, clipped
#   (1, 0.5):  l1 = -0.5,  l2 = -0.8  -> -0.5
#   (-1, 0.5): l1 = 0.5,   l2 = 0.8   -> 0.8, clipped
#   (-1, 4):   l1 = 4,     l2 = 1.28  -> 4, dual clip min(4, 3) = 3, lower-clipped
#   (-1, 1):   1
#   (1, 0.01): -0.01 (dual clip applies only to A < 0, else it would be min(-0.01, -3) = -3)
#   (2, 1.5):  masked out
ADV = t([[1.0, 1.0, -1.0, -1.0], [-1.0, 1.0, 2.0, 0.0]])
RATIO = t([[1.5, 0.5, 0.5, 4.0], [1.0, 0.01, 1.5, 1.0]])
PMASK = t([[1, 1, 1, 1], [1, 1, 0, 0]])
OLD = t([[-1.0, -2.0, -0.5, -3.0], [-1.0, -0.7, -2.0, -1.0]])
VANILLA_TOKENS = [[-1.28, -0.5, 0.8, 3.0], [1.0, -0.01]]


def _vanilla(**kw):
    return policy_loss("vanilla", OLD + RATIO.log(), OLD, ADV, PMASK, clip_low=0.2, clip_high=0.28,
                       dual_clip_c=3.0, **kw)


def test_vanilla_ppo_dual_clip_clip_higher():
    loss, metrics = _vanilla()
    close(loss, (-1.28 - 0.5 + 0.8 + 3.0 + 1.0 - 0.01) / 6)
    assert metrics["actor/clip_frac"] == pytest.approx(2 / 6)
    assert metrics["actor/clip_frac_lower"] == pytest.approx(1 / 6)
    ppo_kl = -(math.log(1.5) + math.log(0.5) + math.log(0.5) + math.log(4) + 0 + math.log(0.01)) / 6
    assert metrics["actor/ppo_kl"] == pytest.approx(ppo_kl)
    assert all(type(v) is float for v in metrics.values())


def test_vanilla_default_symmetric_clip():
    loss, _ = policy_loss("vanilla", OLD + RATIO.log(), OLD, ADV, PMASK)
    # Only the first token changes: clip at 1 + 0.2, so -1.2 instead of -1.28.
    close(loss, (-1.2 - 0.5 + 0.8 + 3.0 + 1.0 - 0.01) / 6)


def test_vanilla_is_weights_and_agg_mode():
    w = t([[0.5, 1.0, 2.0, 1.0], [3.0, 1.0, 100.0, 100.0]])
    loss, _ = _vanilla(is_weights=w)
    close(loss, (-1.28 * 0.5 - 0.5 + 0.8 * 2 + 3.0 + 1.0 * 3 - 0.01) / 6)
    loss, _ = _vanilla(agg_mode="seq-mean-token-sum", global_seqs=4, dp_size=2)
    close(loss, ((-1.28 - 0.5 + 0.8 + 3.0) + (1.0 - 0.01)) / 4 * 2)
    loss, _ = _vanilla(agg_mode="seq-mean-token-mean")
    close(loss, ((-1.28 - 0.5 + 0.8 + 3.0) / 4 + (1.0 - 0.01) / 2) / 2)


def test_vanilla_rejects_dual_clip_at_most_one():
    with pytest.raises(ValueError, match="dual_clip_c"):
        policy_loss("vanilla", OLD, OLD, ADV, PMASK, dual_clip_c=1.0)


def test_vanilla_gradient_is_minus_a_ratio_where_unclipped():
    logp = (OLD + RATIO.log()).requires_grad_(True)
    loss, _ = policy_loss("vanilla", logp, OLD, ADV, PMASK, clip_low=0.2, clip_high=0.28)
    loss.backward()
    # d(-A r)/d logp = -A r on unclipped tokens; clipped and dual-clipped tokens are constant.
    close(logp.grad, [[0, -0.5 / 6, 0, 0], [1.0 / 6, -0.01 / 6, 0, 0]])


def test_vanilla_log_ratio_clamp_keeps_gradients_finite():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[100.0, -100.0]], requires_grad=True)  # exp(100) is inf in float32
    loss, _ = policy_loss("vanilla", logp, old, torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2))
    close(loss.detach(), (3.0 + -math.exp(-20)) / 2, tol=1e-6)  # dual clip -A*3; ratio e^-20
    loss.backward()
    assert torch.isfinite(logp.grad).all()


# GSPO (clip 0.2 / 0.28): s_i = exp(masked mean of log ratios), same value on every token.
#   row 0: log ratios log 2, 0 -> s = sqrt(2) = 1.414, A = 1: max(-1.414, -1.28) = -1.28, clipped
#   row 1: log 0.5, log 0.5, (masked 5.0) -> s = 0.5, A = -1: max(0.5, 0.8) = 0.8, clipped
#   row 2: 0.05 -> s = exp(0.05), A = 2: -2 exp(0.05), unclipped
GOLD = t([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0], [-0.5, -0.5, -0.5]])
GLOGR = t([[math.log(2), 0.0, 0.0], [math.log(0.5), math.log(0.5), 5.0], [0.05, 0.0, 0.0]])
GADV = t([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0], [2.0, 2.0, 2.0]])
GMASK = t([[1, 1, 0], [1, 1, 0], [1, 0, 0]])


def test_gspo_sequence_ratio_and_metrics():
    logp = (GOLD + GLOGR).requires_grad_(True)
    loss, metrics = policy_loss("gspo", logp, GOLD, GADV, GMASK, clip_low=0.2, clip_high=0.28)
    close(loss.detach(), (-1.28 * 2 + 0.8 * 2 - 2 * math.exp(0.05)) / 5)
    assert metrics["actor/clip_frac"] == pytest.approx(4 / 5)
    assert metrics["actor/clip_frac_lower"] == 0.0
    assert metrics["actor/ppo_kl"] == pytest.approx(-(math.log(2) + 2 * math.log(0.5) + 0.05) / 5)
    loss.backward()
    # Stop-gradient trick: each token's gradient is -A * s_i / tokens, not s_i / |y_i| per token.
    close(logp.grad, [[0, 0, 0], [0, 0, 0], [-2 * math.exp(0.05) / 5, 0, 0]])


def test_gspo_gradient_per_token_uses_sequence_ratio():
    old = torch.zeros(2, 3, dtype=F64)
    logp = t([[0.1, -0.1, 0.3], [0.02, 0.04, 9.0]]).requires_grad_(True)
    mask, adv = t([[1, 1, 1], [1, 1, 0]]), t([[1.0] * 3, [-1.0] * 3])
    loss, _ = policy_loss("gspo", logp, old, adv, mask)
    loss.backward()
    s0, s1 = math.exp((0.1 - 0.1 + 0.3) / 3), math.exp((0.02 + 0.04) / 2)  # both inside the clip
    close(loss.detach(), (-3 * s0 + 2 * s1) / 5)
    close(logp.grad, [[-s0 / 5] * 3, [s1 / 5, s1 / 5, 0]])


def test_gspo_token_advantages_weight_each_token_gradient():
    # GSPO-token: with per-token advantages, token t's gradient is -A_t * s / tokens. Differentiating
    # the sequence mean instead would give every token -(sum_k A_k) * s / |y| / tokens = -2 s / 3.
    logp = t([[0.1, -0.1, 0.3]]).requires_grad_(True)
    loss, _ = policy_loss("gspo", logp, torch.zeros(1, 3, dtype=F64), t([[1.0, 2.0, 3.0]]),
                          torch.ones(1, 3, dtype=F64))
    loss.backward()
    s = math.exp((0.1 - 0.1 + 0.3) / 3)  # 1.105, inside [0.8, 1.2]
    close(loss.detach(), -(1 + 2 + 3) * s / 3)
    close(logp.grad, [[-1 * s / 3, -2 * s / 3, -3 * s / 3]])


def test_gspo_log_ratio_clamped_at_10_and_no_dual_clip():
    loss, _ = policy_loss("gspo", t([[20.0]]), t([[0.0]]), t([[-1.0]]), t([[1.0]]))
    close(loss, math.exp(10))  # dual clip would have capped it at 3


def test_gspo_is_weights():
    w = t([[2.0, 1.0, 1.0], [1.0, 0.5, 1.0], [3.0, 1.0, 1.0]])
    loss, _ = policy_loss("gspo", GOLD + GLOGR, GOLD, GADV, GMASK, clip_low=0.2, clip_high=0.28,
                          is_weights=w)
    close(loss, (-1.28 * 2 - 1.28 + 0.8 + 0.8 * 0.5 - 2 * math.exp(0.05) * 3) / 5)


# ----------------------------------------------------------------------------- micro-batch / dp


def _setup(seed=0, n=8, tlen=6):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, tlen, generator=g) * 3
    logp = old + torch.randn(n, tlen, generator=g) * 0.3
    adv = torch.randn(n, 1, generator=g).expand(n, tlen).contiguous()
    lengths = [6, 1, 3, 0, 5, 2, 6, 4]  # one all-padding row
    mask = (torch.arange(tlen)[None] < torch.tensor(lengths)[:, None]).float()
    return logp, old, adv, mask


def _grad(name, mode, logp, old, adv, mask, rows_list, **kw):
    """Sum of the gradients of each micro-batch's loss, like gradient accumulation does."""
    leaf = logp.clone().requires_grad_(True)
    total = 0.0
    for rows in rows_list:
        loss, _ = policy_loss(name, leaf[rows], old[rows], adv[rows], mask[rows], agg_mode=mode,
                              clip_low=0.2, clip_high=0.28, **kw)
        loss.backward()
        total += loss.item()
    return leaf.grad, total


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


MAX_REL_DIFF: list[float] = []


@pytest.mark.parametrize("name", POLICY_LOSSES)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_and_dp_gradients_match_full_batch(name, mode):
    logp, old, adv, mask = _setup()
    n = logp.shape[0]
    counts = dict(global_tokens=mask.sum(), global_seqs=int((mask.sum(-1) > 0).sum()))
    full_grad, full_loss = _grad(name, mode, logp, old, adv, mask, [slice(0, n)])
    assert full_grad.abs().max() > 0
    for mb in (1, 2, 4):
        rows = [slice(i, i + mb) for i in range(0, n, mb)]
        grad, loss = _grad(name, mode, logp, old, adv, mask, rows, **counts)
        MAX_REL_DIFF.append(_rel(grad, full_grad))
        assert _rel(grad, full_grad) < 1e-6
        assert loss == pytest.approx(full_loss, rel=1e-6)
        if mb == 1 and mode != "token-sum":  # without the global counts, per-micro-batch normalisation is
            # wrong (token-sum has no normaliser: a sum is a sum)
            assert _rel(_grad(name, mode, logp, old, adv, mask, rows)[0], full_grad) > 1e-3
    # dp_size = 2: each rank takes half (in micro-batches of 2); FSDP averages rank gradients.
    halves = [[slice(0, 2), slice(2, 4)], [slice(4, 6), slice(6, 8)]]
    rank_grads = [_grad(name, mode, logp, old, adv, mask, h, dp_size=2, **counts)[0] for h in halves]
    dp_grad = (rank_grads[0] + rank_grads[1]) / 2
    MAX_REL_DIFF.append(_rel(dp_grad, full_grad))
    assert _rel(dp_grad, full_grad) < 1e-6


# ----------------------------------------------------------------------------- DAPO helpers


def test_overlong_penalty():
    lengths = torch.tensor([5, 6, 7, 10, 12])  # max_len 10, buffer 4: penalty starts after 6
    expected = [0.0, 0.0, -(7 - 6) / 4 * 0.5, -(10 - 6) / 4 * 0.5, -(12 - 6) / 4 * 0.5]
    close(overlong_penalty(lengths, 10, 4, 0.5), expected, tol=1e-6)
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, 10, 0, 1.0)


def test_group_is_degenerate():
    out = group_is_degenerate(t([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0]), 2)
    assert out.dtype == torch.bool and out.tolist() == [True, False, True, True]
    groups = t([1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0])  # all equal / not / partly equal
    assert group_is_degenerate(groups, 3).tolist() == [True, False, False]


def test_masked_mean_and_whiten():
    x, mask = t([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]]), t([[1, 1, 0], [1, 0, 0]])
    close(masked_mean(x, mask), (1 + 2 + 3) / 3)
    close(masked_mean(x, torch.zeros(2, 3)), 0.0)
    w = whiten_by_hand([1.0, 2.0, 3.0])
    close(masked_whiten(x, mask), [[w[0], w[1], 0], [w[2], 0, 0]])
