"""The rollout-correction family (rlcore/algo/rollout_correction.py) against plain-PyTorch references
written token by token on a hand-built batch, and in the update: each mode changes the gradient
only where its definition says (a rejected sequence's gradient is that of the batch without it)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rlcore import advantage
from rlcore.algo import grpo, rollout_correction as rc
from rlcore.algo.batch import advantages_for, shape_rewards
from rlcore.config import ConfigError, RolloutCorrectionConfig

pytestmark = pytest.mark.unit

# 3 sequences of lengths 3, 2, 4 (padded to 4); log rho = old - rollout, by hand
OLD = torch.tensor([[-1.0, -0.5, -2.0, 0.0], [-0.1, -3.0, 0.0, 0.0], [-1.2, -0.7, -0.3, -2.5]])
ROLL = torch.tensor([[-1.5, -0.5, -1.0, 0.0], [-0.1, -0.2, 0.0, 0.0], [-1.0, -0.9, -0.3, -2.4]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
LOG_RHO = [[0.5, 0.0, -1.0], [0.0, -2.8], [-0.2, 0.2, 0.0, -0.1]]  # per sequence, its real tokens


def ref_weight(seq: list[float], level: str) -> list[float]:
    if level == "token":
        return [math.exp(x) for x in seq]
    total = sum(seq) if level == "sequence" else sum(seq) / len(seq)
    return [math.exp(total)] * len(seq)


def as_matrix(rows: list[list[float]]) -> torch.Tensor:
    out = torch.zeros(3, 4)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r)
    return out


@pytest.mark.parametrize("level", rc.IS_LEVELS)
@pytest.mark.parametrize("mode", rc.IS_MODES)
@pytest.mark.parametrize("normalizer", rc.IS_MASK_NORMALIZERS)
def test_importance_weights_equal_the_reference(level, mode, normalizer):
    low, high = 0.5, 1.5
    corr, sums = rc.correct(OLD, ROLL, MASK, is_level=level, is_mode=mode, is_low=low, is_high=high,
                            rs=None, rs_threshold=None, rs_low=None, is_mask_normalizer=normalizer)
    weights, keep = [], []
    for seq in LOG_RHO:
        w = ref_weight(seq, level)
        if mode == "truncate":
            weights.append([min(x, high) for x in w])
            keep.append([1.0] * len(w))
        else:
            inside = [1.0 if low <= x <= high else 0.0 for x in w]
            weights.append([x * k for x, k in zip(w, inside)])
            keep.append(inside)
    assert torch.allclose(corr.weights * MASK, as_matrix(weights), atol=1e-6)
    # out-of-band tokens: weight 0, and still in the normaliser unless is_mask_normalizer is "kept"
    assert torch.equal(corr.keep, as_matrix(keep) if normalizer == "kept" else MASK)
    kept_w = [x for ws, ks in zip(weights, keep) for x, k in zip(ws, ks) if k]
    m = rc.summarise(dict(sums), sums["w_max"])
    assert m["rollout_corr/is_weight_mean"] == pytest.approx(sum(kept_w) / len(kept_w), rel=1e-6)
    assert m["rollout_corr/ess"] == pytest.approx(sum(kept_w) ** 2 / (len(kept_w) * sum(x * x for x in kept_w)),
                                                  rel=1e-6)
    assert m["rollout_corr/is_masked_frac"] == pytest.approx((9 - len(kept_w)) / 9)


# A (2, 3) batch with 5 response tokens, one (log rho 1.0: rho e = 2.718) outside the band [0.5, 2];
# on-policy (ratio 1), so each token's PPO term is -A: -1 in sequence 0, +0.5 in sequence 1.
ICE_LOG_RHO = torch.tensor([[0.1, 1.0, -0.2], [0.0, 0.3, 0.0]])
ICE_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ICE_ADV = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]])
# sum over the in-band tokens of w * term: -e^0.1 - e^-0.2 + 0.5 * 1 + 0.5 * e^0.3
ICE_SUM = -1.1051709 - 0.8187308 + 0.5 + 0.6749294  # -0.7489723


def ice_loss(**kw) -> float:
    """The token-mean policy loss as ppo_update computes it: the response mask times
    ``Correction.keep`` is the loss mask (and its normaliser), ``Correction.weights`` multiply each term."""
    old = torch.zeros(2, 3)
    corr, _ = rc.correct(old, old - ICE_LOG_RHO, ICE_MASK, is_level="token", is_mode="mask", is_low=0.5,
                         is_high=2.0, **{"rs": None, "rs_threshold": None, "rs_low": None, **kw})
    mask = ICE_MASK * corr.keep
    loss, _ = advantage.policy_loss("vanilla", old, old, ICE_ADV, mask, is_weights=corr.weights,
                                    agg_mode="token-mean", global_tokens=mask.sum().item())
    return loss.item()


def test_icepop_masked_token_stays_in_the_normaliser():
    """IcePop (arXiv:2510.18855) and verl 0.9.1: the out-of-band token adds 0 to the sum and 1 to
    the count, -0.7489723 / 5 = -0.1497945; the old normaliser ("kept") divides by 4: -0.1872431."""
    assert ice_loss() == pytest.approx(ICE_SUM / 5, abs=1e-6)
    assert ice_loss() == pytest.approx(-0.1497945, abs=1e-6)
    assert ice_loss(is_mask_normalizer="kept") == pytest.approx(ICE_SUM / 4, abs=1e-6)
    assert abs(ice_loss() - ice_loss(is_mask_normalizer="kept")) > 0.03


def test_rejection_still_shrinks_the_normaliser():
    """rs token_k1 with rho >= 0.9 rejects the token with rho e^-0.2 = 0.819: it leaves the sum and
    the count (4 tokens), while the out-of-band token stays counted: (ICE_SUM + e^-0.2) / 4."""
    loss = ice_loss(rs="token_k1", rs_threshold=1e9, rs_low=0.9)
    assert loss == pytest.approx((ICE_SUM + 0.8187308) / 4, abs=1e-6)
    assert loss == pytest.approx(0.0174396, abs=1e-6)
    kept = ice_loss(rs="token_k1", rs_threshold=1e9, rs_low=0.9, is_mask_normalizer="kept")
    assert kept == pytest.approx((ICE_SUM + 0.8187308) / 3, abs=1e-6)


def test_geometric_and_sequence_weights_by_hand():
    # sequence 0: log rho 0.5, 0, -1: product e^-0.5 = 0.6065, geometric mean e^(-0.5/3) = 0.8465
    corr, _ = rc.correct(OLD, ROLL, MASK, is_level="sequence", is_mode="truncate", is_low=0.5, is_high=2.0,
                         rs=None, rs_threshold=None, rs_low=None)
    assert corr.weights[0, 0].item() == pytest.approx(0.60653, abs=1e-5)
    corr, _ = rc.correct(OLD, ROLL, MASK, is_level="geometric", is_mode="truncate", is_low=0.5, is_high=2.0,
                         rs=None, rs_threshold=None, rs_low=None)
    assert corr.weights[0, 2].item() == pytest.approx(0.84648, abs=1e-5)


def ref_divergence(x: float, k: str) -> float:
    return {"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1 - x}[k]


@pytest.mark.parametrize("mode", rc.RS_MODES)
def test_rejection_equals_the_reference(mode):
    threshold = 1.3 if mode.endswith("k1") else 0.05
    corr, sums = rc.correct(OLD, ROLL, MASK, is_level=None, is_mode="truncate", is_low=0.5, is_high=2.0,
                            rs=mode, rs_threshold=threshold, rs_low=None)
    scope, k = mode.rsplit("_k", 1)
    k = "k" + k
    keep = []
    for seq in LOG_RHO:
        if k == "k1":
            def ok(v):
                return 1 / threshold <= math.exp(v) <= threshold
            if scope == "token":
                keep.append([float(ok(x)) for x in seq])
            else:
                agg = sum(seq) if scope == "seq_sum" else sum(seq) / len(seq)
                keep.append([float(ok(agg))] * len(seq))
        else:
            d = [ref_divergence(x, k) for x in seq]
            if scope == "token":
                keep.append([float(v <= threshold) for v in d])
            else:
                agg = {"seq_sum": sum(d), "seq_mean": sum(d) / len(d), "seq_max": max(d)}[scope]
                keep.append([float(agg <= threshold)] * len(seq))
    assert torch.equal(corr.keep, as_matrix(keep)), (mode, corr.keep, keep)
    assert corr.weights is None
    m = rc.summarise(dict(sums), None)
    rejected = [r for r in keep if min(r) == 0]
    assert m["rollout_corr/rs_rejected_seq_frac"] == pytest.approx(len(rejected) / 3)
    assert m["rollout_corr/rs_rejected_token_frac"] == pytest.approx(sum(r.count(0.0) for r in keep) / 9)


def test_off_policy_diagnostics_by_hand():
    _, sums = rc.correct(OLD, ROLL, MASK, is_level=None, is_mode="truncate", is_low=0.5, is_high=2.0,
                         rs="token_k2", rs_threshold=100.0, rs_low=None)
    m = rc.summarise(dict(sums), None)
    flat = [x for s in LOG_RHO for x in s]
    assert m["rollout_corr/kl_k1"] == pytest.approx(sum(-x for x in flat) / 9, rel=1e-6)
    assert m["rollout_corr/kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in flat) / 9, rel=1e-6)
    assert m["rollout_corr/chi2_token"] == pytest.approx(sum(math.exp(2 * x) - 1 for x in flat) / 9, rel=1e-6)
    assert m["rollout_corr/chi2_seq"] == pytest.approx(sum(math.exp(2 * sum(s)) - 1 for s in LOG_RHO) / 3, rel=1e-6)


def test_extreme_ratios_stay_finite():
    old = torch.tensor([[0.0, 0.0]])
    roll = torch.tensor([[-300.0, 300.0]])
    mask = torch.ones(1, 2)
    for level in rc.IS_LEVELS:
        corr, sums = rc.correct(old, roll, mask, is_level=level, is_mode="mask", is_low=0.5, is_high=2.0,
                                rs="seq_sum_k3", rs_threshold=1.0, rs_low=None)
        assert torch.isfinite(corr.weights).all() and all(math.isfinite(v) for v in sums.values())


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, "0.5_1.5"])
@pytest.mark.parametrize("ranks", [1, 3])
def test_batch_normalized_weights_equal_verls(level, threshold, ranks):
    """is_batch_normalize against verl's own compute_rollout_correction_weights with
    rollout_is_batch_normalize=True (tests/verl_reference.py, copied from verl 1dda039) on a random
    batch, within 1e-6 in float64: the batch split over ``ranks`` ranks, each rank's sums added as
    all_rank_sums adds them, every rank's weights divided by the one batch mean."""
    from verl_reference import compute_rollout_correction_weights

    g = torch.Generator().manual_seed(7)
    n, t = 12, 9
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).double()  # (N, T)
    old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3
    roll = old + 0.4 * torch.randn(n, t, generator=g, dtype=torch.float64)
    want, metrics = compute_rollout_correction_weights(old - roll, mask, level, threshold, True)
    low, high = (None, float(threshold)) if isinstance(threshold, float) else map(float, threshold.split("_"))
    opts = dict(is_level=level, is_mode="truncate" if low is None else "mask", is_low=low or 0.5, is_high=high,
                rs=None, rs_threshold=None, rs_low=None, is_batch_normalize=True)
    parts = [rc.correct(old[i::ranks], roll[i::ranks], mask[i::ranks], **opts) for i in range(ranks)]
    total = {}
    for _, sums in parts:
        for k, v in sums.items():
            total[k] = total.get(k, 0.0) + v
    got = torch.zeros_like(want)
    for i, (corr, _) in enumerate(parts):
        factor = rc.batch_normalize(corr, total)
        assert factor["rollout_corr/is_batch_norm_factor"] == pytest.approx(metrics["rollout_is_batch_norm_factor"],
                                                                          rel=1e-6)
        got[i::ranks] = corr.weights * mask[i::ranks]
    assert torch.allclose(got, want, atol=1e-6, rtol=0), (got - want).abs().max()
    assert not torch.allclose(got, rc.correct(old, roll, mask, **{**opts, "is_batch_normalize": False})[0].weights * mask)


def test_batch_normalize_needs_importance_weights_and_a_positive_mean():
    """Off without is_level (verl normalises IS weights only); a batch whose weights are all masked
    to 0 keeps them (verl: a mean <= 1e-8 divides nothing, factor 1)."""
    corr, sums = rc.correct(OLD, ROLL, MASK, is_level=None, is_mode="truncate", is_low=0.5, is_high=2.0,
                            rs="token_k2", rs_threshold=1.0, rs_low=None, is_batch_normalize=True)
    assert rc.batch_normalize(corr, sums) == {} and corr.weights is None
    corr, sums = rc.correct(OLD, ROLL, MASK, is_level="token", is_mode="mask", is_low=10.0, is_high=20.0,
                            rs=None, rs_threshold=None, rs_low=None, is_batch_normalize=True)
    assert rc.batch_normalize(corr, sums) == {"rollout_corr/is_batch_norm_factor": 1.0}
    assert float(corr.weights.abs().sum()) == 0.0


def test_batch_normalize_in_the_update():
    """In train_on_batch: the factor is logged, the weight statistics are the weights' before it (as
    verl's), and the gradient is the plain IS gradient divided by the factor (the loss is linear in
    the weights on one on-policy update)."""
    plain, m0 = update(options(is_level="sequence", is_high=5.0))
    normed, m1 = update(options(is_level="sequence", is_high=5.0, is_batch_normalize=True))
    factor = m1["rollout_corr/is_batch_norm_factor"]
    assert factor != pytest.approx(1.0) and m1["rollout_corr/is_weight_mean"] == m0["rollout_corr/is_weight_mean"]
    assert torch.allclose(normed, plain / factor, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- in the update


def update(correction=None, keep_by_hand=None, tis_cap=None):
    """One on-policy update of the fake policy on test_grpo_options' batch, whose vLLM log-probs
    are shifted per sequence so the modes have something to act on."""
    from tests.test_grpo_options import BASE, SCORES, FakePolicy, make_batch

    cfg = dataclasses.replace(BASE, kl_loss_coef=0.0)
    torch.manual_seed(0)
    policy, batch = FakePolicy(), make_batch()
    batch.rollout_logp = [[-1.0 - 0.4 * i] * len(r) for i, r in enumerate(batch.response_ids)]
    if keep_by_hand is not None:
        batch.keep = keep_by_hand
    scores, _ = shape_rewards(SCORES.clone(), batch, cfg, max_response_length=6)
    adv = advantages_for(batch, scores, cfg)
    metrics = grpo.train_on_batch(policy, None, batch, adv, cfg, 1.0, 1, "cpu", norm_len=6, tis_cap=tis_cap,
                                  correction=correction)
    return policy.grads[0], metrics


def options(**kw):
    return RolloutCorrectionConfig(**kw).options()


def test_rejected_sequences_leave_the_loss_and_its_normaliser():
    """The gradient with a sequence rejected equals the gradient of the same batch with that
    sequence's tokens removed by hand (batch.keep: out of the loss and the token count)."""
    _, probe = update(options(rs="seq_mean_k1", rs_threshold=1e9, rs_low=1e-9))  # nothing rejected
    assert probe["rollout_corr/rs_rejected_seq_frac"] == 0
    corr_opts = options(rs="seq_mean_k3", rs_threshold=1.0)
    grads, m = update(corr_opts)
    # which sequences did it reject? those whose mean k3 > 1: recompute from the metrics' source
    from tests.test_grpo_options import FakePolicy, make_batch

    batch = make_batch()
    old = grpo.compute_logprobs_in_chunks(FakePolicy(), batch, 1.0, 8, "cpu")
    roll = torch.tensor([[-1.0 - 0.4 * i] * 6 for i in range(8)])
    mask = batch.response_mask()
    lr = (old - roll) * mask
    k3 = ((torch.exp(lr) - 1 - lr) * mask).sum(1) / mask.sum(1)
    rejected = (k3 > 1.0).tolist()
    assert 0 < sum(rejected) < 8, k3
    assert m["rollout_corr/rs_rejected_seq_frac"] == pytest.approx(sum(rejected) / 8)
    by_hand, _ = update(keep_by_hand=[0.0 if r else 1.0 for r in rejected])
    assert torch.allclose(grads, by_hand, rtol=1e-5, atol=1e-7)
    plain, _ = update()
    assert not torch.allclose(grads, plain)


def test_token_truncation_equals_tis_cap():
    """is_level token + truncate at 2 is the same estimator as the older tis_cap 2 (two code paths)."""
    a, ma = update(options(is_level="token", is_high=2.0))
    b, mb = update(tis_cap=2.0)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-7) and ma["rollout_corr/is_weight_max"] <= 2.0
    plain, _ = update()
    assert not torch.allclose(a, plain)


def test_masked_is_drops_tokens_outside_the_band():
    grads, m = update(options(is_level="geometric", is_mode="mask", is_low=0.2, is_high=3.0))
    frac = m["rollout_corr/is_masked_frac"]
    assert 0 < frac < 1 and 0 < m["rollout_corr/ess"] <= 1
    plain, _ = update()
    assert not torch.allclose(grads, plain)
    # token-mean: the same sum over all response tokens (default) or over the in-band ones ("kept")
    kept, _ = update(options(is_level="geometric", is_mode="mask", is_low=0.2, is_high=3.0,
                             is_mask_normalizer="kept"))
    assert torch.allclose(grads, kept * (1 - frac), rtol=1e-5, atol=1e-7)


def test_config_checks_name_the_fix():
    with pytest.raises(ConfigError, match="rollout_correction.rs_threshold"):
        RolloutCorrectionConfig(rs="seq_mean_k3")
    with pytest.raises(ConfigError, match="choose one of token_k1"):
        RolloutCorrectionConfig(rs="seq_mean_k4", rs_threshold=1.0)
    with pytest.raises(ConfigError, match="rollout_correction.tis_cap"):
        RolloutCorrectionConfig(tis_cap=2.0, is_level="token")
    with pytest.raises(ConfigError, match="is_level"):
        RolloutCorrectionConfig(is_level="tokens")
    with pytest.raises(ConfigError, match=r"rollout_correction.is_mask_normalizer='some'.*choose all"):
        RolloutCorrectionConfig(is_level="token", is_mode="mask", is_mask_normalizer="some")
    assert options(is_level="token", is_mode="mask")["is_mask_normalizer"] == "all"
    assert RolloutCorrectionConfig().options() is None
    assert options(is_level="token", is_high=4.0)["is_low"] == 0.25
