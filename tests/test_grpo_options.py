"""Every algorithm option reaches the loss: the same batch through advantages_for +
grpo.ppo_update with one option changed gives a different first-step gradient (or the documented
invariance). The policy here is a small plain-PyTorch LM fake; the FSDP engine is tested elsewhere."""

from __future__ import annotations

import copy
import math
import dataclasses

import pytest
import torch

from rlcore.algo import grpo, packing
from rlcore.algo.batch import RolloutBatch, advantages_for, shape_rewards
from rlcore.config import AlgorithmConfig

pytestmark = pytest.mark.unit  # pure logic: no torchrun, no vLLM, no model build

VOCAB = 12


class FakePolicy(torch.nn.Module):
    """The engine interface (forward_logprobs / backward / step) over a tiny bigram-ish LM."""

    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(VOCAB, 8, generator=g))
        self.pos = torch.nn.Parameter(torch.randn(32, 8, generator=g) * 0.1)
        self.head = torch.nn.Parameter(torch.randn(8, VOCAB, generator=g))
        self.opt = torch.optim.SGD(self.parameters(), lr=0.5)
        self.grads: list[torch.Tensor] = []

    def forward_logprobs(self, input_ids, position_ids, labels, temperature=1.0, with_entropy=False, grad=True,
                         select=None, attention_mask=None):  # no attention here: the mask changes nothing
        with torch.set_grad_enabled(grad):
            h = torch.tanh(self.emb[input_ids] + self.pos[position_ids])  # (1, L, 8)
            h = h if select is None else h[:, select]  # (1, K, 8)
            logits = (h @ self.head) / temperature  # (1, L, V)
            logp_all = torch.log_softmax(logits, -1)
            logp = logp_all.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (labels != -100)
            ent = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
        return logp, ent

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.grads.append(torch.cat([p.grad.flatten() for p in self.parameters()]).clone())
        norm = self.grads[-1].norm().item()
        self.opt.step()
        self.opt.zero_grad()
        return {"actor/grad_norm": norm, "actor/lr": 0.5, "actor/skipped": 0}


def make_batch():
    g = torch.Generator().manual_seed(1)
    prompts, responses, finish = [], [], []
    for i in range(8):  # 2 groups of 4
        prompts.append(torch.randint(0, VOCAB, (3,), generator=g).tolist())
        n = [5, 2, 6, 3, 4, 6, 1, 5][i]
        responses.append(torch.randint(0, VOCAB, (n,), generator=g).tolist())
        finish.append("length" if n == 6 else "stop")
    return RolloutBatch(prompts, responses, [[0.0] * len(r) for r in responses], ["x"] * 8, finish, 4)


def perturbed(scale, seed):
    """The current policy's parameters plus noise: ratios spread around 1 across the clip range."""
    p = FakePolicy()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in p.parameters():
            param.add_(torch.randn(param.shape, generator=g) * scale)
    return p


SCORES = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.2])


def run(cfg: AlgorithmConfig, steps_out=False):
    torch.manual_seed(0)
    policy, batch = FakePolicy(), make_batch()
    scores, _ = shape_rewards(SCORES.clone(), batch, cfg, max_response_length=6)
    adv = advantages_for(batch, scores, cfg)
    # old and reference policies differ from the current one, so ratios and KL are far from trivial
    old = grpo.compute_logprobs_in_chunks(perturbed(0.15, 2), batch, 1.0, 8, "cpu")
    ref = grpo.compute_logprobs_in_chunks(perturbed(0.5, 3), batch, 1.0, 8, "cpu")
    metrics = grpo.ppo_update(policy, batch, adv, old, ref if cfg.kl_loss_coef else None, cfg, 1.0,
                              world_size=1, device="cpu", norm_len=6)
    return (policy.grads, metrics) if steps_out else policy.grads[0]


BASE = AlgorithmConfig(micro_batch_size=8, kl_loss_coef=0.1)
CHANGES = {
    "adv_estimator": "rloo", "norm_by_std": False, "policy_loss": "gspo", "clip_low": 0.05,
    "clip_high": 0.6, "dual_clip_c": 1.2, "loss_agg_mode": "seq-mean-token-sum", "kl_loss_coef": 0.5,
    "kl_loss_type": "k1", "entropy_coef": 0.3, "overlong_buffer_len": 3, "mask_truncated": True,
}


@pytest.mark.parametrize("key", sorted(CHANGES))
def test_option_changes_the_gradient(key):
    base = run(BASE)
    changed = run(dataclasses.replace(BASE, **{key: CHANGES[key]}))
    rel = (changed - base).norm() / base.norm()
    assert rel > 1e-4, f"algorithm.{key}={CHANGES[key]!r} did not reach the loss (rel diff {rel:.2e})"


def test_gamma_reaches_reinforce_pp():
    cfg = dataclasses.replace(BASE, adv_estimator="reinforce_pp")
    assert (run(cfg) - run(dataclasses.replace(cfg, gamma=0.5))).norm() > 1e-4


def test_overlong_penalty_factor_reaches_the_loss():
    cfg = dataclasses.replace(BASE, overlong_buffer_len=3, adv_estimator="reinforce_pp")
    assert (run(cfg) - run(dataclasses.replace(cfg, overlong_penalty_factor=3.0))).norm() > 1e-4


def test_epochs_and_mini_batches_set_the_number_of_steps():
    grads, metrics = run(dataclasses.replace(BASE, ppo_epochs=2, mini_batches=2), steps_out=True)
    assert len(grads) == 4
    assert metrics["actor/grad_norm"] > 0 and 0 <= metrics["actor/clip_frac"] <= 1


def test_micro_batch_size_does_not_change_the_gradient():
    base = run(dataclasses.replace(BASE, micro_batch_size=8))
    for size in (1, 2, 3):
        other = run(dataclasses.replace(BASE, micro_batch_size=size))
        assert ((other - base).norm() / base.norm()) < 1e-6, size


def test_mask_truncated_removes_truncated_sequences_from_the_loss():
    batch = make_batch()
    shape_rewards(SCORES.clone(), batch, dataclasses.replace(BASE, mask_truncated=True), 6)
    mask = batch.response_mask()
    assert mask[2].sum() == 0 and mask[5].sum() == 0 and mask[0].sum() == 5
    assert copy.copy(batch).keep == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]


def test_dynamic_sampling_rounds_draw_fresh_seeds():
    """Each extra round of a step gets its own generation seed (round 0 keeps the step's, which
    resume exactness relies on): a round that reused it would draw the same random stream."""
    import contextlib
    import types

    from rlcore.colocate_rollout import Sample
    from rlcore.step.sampling import StepSampler

    seeds = []

    class RecordingRollout:  # records what the trainer asks of the engine
        def generate(self, prompt_ids, n, seed, **sampling):
            seeds.append(seed)
            return [[Sample([1, 2], [-0.5, -0.5], "stop") for _ in range(n)] for _ in prompt_ids]

    rollout_cfg = types.SimpleNamespace(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_response_length=2)
    sampler = StepSampler(RecordingRollout(), None, None, None, rollout_cfg, None, 1, 7,
                          lambda _: contextlib.nullcontext())
    prompts = [types.SimpleNamespace(ids=[3, 4], answer="1", row=None)]
    for round_ in range(3):
        batch = sampler.generate(prompts, 5, round_)
        assert len(batch) == 2
    sampler.generate(prompts, 6)
    assert seeds[0] == 7 * 1_000_003 + 5 and len(set(seeds)) == 4, seeds


def test_tis_weights_are_capped_and_reach_the_gradient():
    """min(exp(old - rollout), cap), detached; tokens above the cap counted in rollout/tis_clip_frac."""
    old = torch.tensor([[0.0, -1.0, -2.0], [-0.5, 0.0, 0.0]])
    rollout = torch.tensor([[-1.0, -1.0, -0.5], [-0.5, -3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w, clipped = grpo.tis_weights(old, rollout, mask, cap=2.0)
    expected = torch.tensor([[min(math.e, 2.0), 1.0, math.exp(-1.5)], [1.0, 2.0, 1.0]])
    assert torch.allclose(w, expected) and clipped == 2  # e^1 and e^3 capped; the masked 1.0 not counted
    # Through the update: with a stale rollout (its log-probs 5 nats lower) the capped weights
    # change the gradient, against the same update without TIS.
    base = dataclasses.replace(BASE, kl_loss_coef=0.0)

    def update(cfg, tis_cap=None):
        torch.manual_seed(0)
        policy, batch = FakePolicy(), make_batch()
        batch.rollout_logp = [[lp - 5.0 for lp in r] for r in batch.rollout_logp]
        scores, _ = shape_rewards(SCORES.clone(), batch, cfg, max_response_length=6)
        adv = advantages_for(batch, scores, cfg)
        metrics = grpo.ppo_update(policy, batch, adv, None, None, cfg, 1.0, world_size=1, device="cpu", norm_len=6,
                                  tis_cap=tis_cap)
        return policy.grads, metrics

    off_grads, off = update(base)
    on_grads, on = update(dataclasses.replace(base), tis_cap=2.0)
    assert "rollout/tis_clip_frac" not in off and 0 < on["rollout/tis_clip_frac"] <= 1
    assert not torch.allclose(on_grads[0], off_grads[0])
    assert on["rollout/mismatch_max"] > 4.0  # the shifted rollout shows as a mismatch


def test_use_rollout_logprobs_takes_vllms_logprobs_as_old():
    cfg = dataclasses.replace(BASE, kl_loss_coef=0.0, use_rollout_logprobs=True)
    torch.manual_seed(0)
    policy, batch = FakePolicy(), make_batch()
    scores, _ = shape_rewards(SCORES.clone(), batch, cfg, max_response_length=6)
    adv = advantages_for(batch, scores, cfg)
    metrics = grpo.train_on_batch(policy, None, batch, adv, cfg, 1.0, 1, "cpu", norm_len=6)
    # The rollout log-probs of make_batch are not the policy's: ratios != 1, so clipping can act.
    assert metrics["actor/ppo_kl"] != 0.0
    with pytest.raises(ValueError, match="ppo_epochs=1 and mini_batches=1"):
        AlgorithmConfig(use_rollout_logprobs=True, mini_batches=2)


def test_token_budget_micro_batches_balance_tokens_and_keep_the_gradient():
    lengths = [9, 2, 7, 3, 8, 1, 6, 4]
    parts = packing.token_budget_batches(lengths, budget=12)  # 40 tokens -> ceil(40 / 12) = 4 micro-batches
    assert len(parts) == 4 and sorted(i for p in parts for i in p) == list(range(8))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(lengths), loads
    assert len(packing.token_budget_batches([50, 50], budget=10)) == 2  # never more than the sequences
    base = run(BASE)
    for budget in (9, 20, 1000):  # one long sequence per micro-batch .. all in one
        grads = run(dataclasses.replace(BASE, micro_batch_tokens=budget))
        assert (grads - base).norm() / base.norm() <= 1e-5


def test_sapo_gate_temperatures_reach_the_loss():
    cfg = dataclasses.replace(BASE, policy_loss="sapo")
    assert (run(cfg) - run(dataclasses.replace(cfg, sapo_tau_neg=3.0))).norm() > 1e-4
    assert (run(cfg) - run(dataclasses.replace(cfg, sapo_tau_pos=3.0))).norm() > 1e-4


@pytest.mark.parametrize("metric, kept", [("reward", [0, 1]), ("score", [1])])
def test_dynamic_sampling_metric_score_compares_before_the_overlong_penalty(metric, kept):
    """Group 0 scores 1 everywhere but its responses run past the overlong buffer by different
    amounts: its shaped rewards differ (kept with metric reward, verl's seq_reward), its scores do
    not (dropped with metric score, verl's score / acc filter). Group 1 differs either way."""
    import types

    from rlcore.algo.batch import informative_groups
    from rlcore.step.sampling import StepSampler

    batch = make_batch()  # lengths 5 2 6 3 | 4 6 1 5
    cfg = dataclasses.replace(BASE, overlong_buffer_len=3, dynamic_sampling=True, dynamic_sampling_metric=metric)
    scores = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    shaped, _ = shape_rewards(scores.clone(), batch, cfg, max_response_length=6)
    off = types.SimpleNamespace(enable=False)
    rollout_cfg = types.SimpleNamespace(max_response_length=6, multi_turn=off, agent=off)
    sampler = StepSampler(None, None, None, None, rollout_cfg, cfg,
                          1, 0, None)
    assert informative_groups(sampler.filter_values(batch, shaped), 4) == kept
