"""Learning per minute: dynamic sampling sized in one round (rlcore.step.sampling) and the exploration
mechanisms (rlcore.algo.exploration, advantage.clip_cov_weights), each against a hand or independent
computation. The engine here is a scripted recorder of generate calls (the sampler's logic); the
real vLLM engine runs the same sampler in tests/test_e2e.py."""

from __future__ import annotations

import contextlib
import json
import dataclasses
import types

import pytest
import torch

from rlcore import advantage
from rlcore.algo import grpo
from rlcore.algo.batch import advantages_for, informative_groups, shape_rewards
from rlcore.algo.exploration import EntropyControl, clip_cov_options, next_entropy_coef
from rlcore.config import AlgorithmConfig, ExplorationConfig, RolloutConfig
from rlcore.colocate_rollout import Sample
from rlcore.step import sampling

pytestmark = pytest.mark.unit


def binomial_tail(m: int, p: float, k: int) -> float:
    """P(X >= k), X ~ Binomial(m, p), by torch.distributions (independent of sampling.binomial_at_least)."""
    dist = torch.distributions.Binomial(total_count=m, probs=torch.tensor(p, dtype=torch.float64))
    return dist.log_prob(torch.arange(k, m + 1, dtype=torch.float64)).exp().sum().item()


@pytest.mark.parametrize("needed,p,replicas", [(4, 0.35, 2), (4, 0.5, 1), (8, 0.2, 4), (1, 0.9, 1), (16, 0.6, 8)])
def test_plan_prompts_is_the_smallest_round_that_keeps_enough(needed, p, replicas):
    m = sampling.plan_prompts(needed, p, max_factor=10.0, replicas=replicas)
    want = 0.8 ** (1 / replicas)
    assert binomial_tail(m, p, needed) >= want - 1e-12
    assert m == needed or binomial_tail(m - 1, p, needed) < want


def test_plan_prompts_bounds():
    assert sampling.plan_prompts(4, 1.0, 4.0) == 4  # everything kept: no oversampling
    assert sampling.plan_prompts(4, 0.01, 4.0) == 16  # hopeless estimate: the cap, 4 x 4
    assert sampling.plan_prompts(4, 0.3, 1.0) == 4  # oversample_max 1: never more than needed
    assert sampling.plan_prompts(0, 0.3, 4.0) == 0
    # hand value: needed 4, p 0.5, one replica: P(Bin(11, .5) >= 4) = 1 - (1+11+55+165)/2048 = 0.8867
    # and P(Bin(10, .5) >= 4) = 1 - 176/1024 = 0.828, P(Bin(9, .5) >= 4) = 1 - 130/512 = 0.746
    assert sampling.plan_prompts(4, 0.5, 4.0) == 10


def test_choose_groups_is_uniform_and_seeded():
    informative = [0, 2, 3, 5, 7, 8, 9, 11]
    counts = torch.zeros(12)
    for seed in range(4000):
        picked = sampling.choose_groups(informative, 3, seed)
        assert picked == sorted(picked) and len(set(picked)) == 3 and set(picked) <= set(informative)
        counts[picked] += 1
    freq = counts[informative] / 4000  # each should be 3/8 = 0.375
    assert (freq - 0.375).abs().max() < 0.03, freq  # 4000 draws: sd ~ 0.008
    assert sampling.choose_groups(informative, 3, 5) == sampling.choose_groups(informative, 3, 5)
    assert sampling.choose_groups([1, 4], 3, 0) == [1, 4]


class ScriptedRollout:
    """Records each generate call; prompt answer 'mix' yields a group with rewards 0 and 1, any
    other answer a group of equal rewards (zero variance)."""

    dp_rank, dp_size, tp_size = 0, 1, 1

    def __init__(self):
        self.calls = []

    def generate(self, prompt_ids, n, seed, **sampling_args):
        self.calls.append(len(prompt_ids))
        return [[Sample([7 + (i % 2)], [-0.5], "stop") for i in range(n)] for _ in prompt_ids]


class Scorer:
    def score(self, texts, answers, env_rewards=None, rows=None):
        return [float(a == "mix" and t == "8") for t, a in zip(texts, answers)], {"reward/math": 0.0}


class Tokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [str(x[0]) for x in ids]


def make_sampler(answers: list[str], algo: AlgorithmConfig, prompts_per_step: int = 4):
    from rlcore.task.prompts import PromptSampler

    prompts = [types.SimpleNamespace(ids=[1, i], answer=a, images=None, row=None) for i, a in enumerate(answers)]
    cfg = RolloutConfig(n=4, temperature=1.0, top_p=1.0, top_k=-1, max_response_length=4)
    rollout = ScriptedRollout()
    s = sampling.StepSampler(rollout, PromptSampler(prompts, 0, shuffle=False), Tokenizer(), Scorer(), cfg, algo,
                             prompts_per_step, 3, lambda _: contextlib.nullcontext())
    return s, rollout


ALGO = AlgorithmConfig(dynamic_sampling=True, max_sampling_rounds=3, oversample=True)


def test_one_round_when_the_estimate_holds():
    answers = ["mix", "same"] * 50  # half the groups informative
    s, rollout = make_sampler(answers, ALGO)
    batch, scores, m = s.sample(1)
    assert rollout.calls == [sampling.plan_prompts(4, 0.5, 4.0)] == [10]  # one round, sized by the prior 0.5
    assert len(batch) == 16 and len(informative_groups(scores, 4)) == 4  # 4 kept groups, all informative
    assert m["rollout/sampling_rounds"] == 1 and m["rollout/generated_per_trained"] == 10 / 4
    assert m["rollout/zero_variance_groups_frac"] == 0.5 and s.keep_rate == 0.5  # 5 kept of 10, prior 0.5
    assert all(k == 1.0 for k in batch.keep)


def test_fallback_round_and_estimate_update():
    answers = ["mix"] + ["same"] * 9  # 1 group in 10 informative
    s, rollout = make_sampler(answers * 10, ALGO)
    batch, scores, m = s.sample(1)
    # round 0: 10 prompts (prior 0.5), 1 kept: 1/10 seen. Round 1, for the 3 missing at rate 0.1:
    # the cap, 12 prompts (10..21), 2 kept (10, 20): 3/22. Round 2, 1 missing at 3/22: P(Bin(m, .136)
    # >= 1) >= 0.8 needs m = 11, over the cap 4 x 1: 4 prompts (22..25), none kept.
    assert rollout.calls == [10, 12, 4] and m["rollout/sampling_rounds"] == 3
    assert s.keep_rate == pytest.approx(0.5 + 0.5 * (3 / 26 - 0.5))
    assert m["rollout/generated_per_trained"] == 26 / 4
    assert sum(batch.keep) == 3 * 4  # the 4th group: a dropped one, masked out of the loss
    s2, _ = make_sampler(answers * 10, ALGO)
    s2.load_state_dict(s.state_dict())
    assert s2.keep_rate == s.keep_rate and s2.state_dict() == {"keep_rate": s.keep_rate}


def test_oversample_resolves_per_device():
    from rlcore.config import Config, resolve

    cfg = Config()
    assert resolve(cfg, "cpu").algorithm.oversample is False and resolve(cfg, "cuda").algorithm.oversample is True
    forced = dataclasses.replace(cfg, algorithm=AlgorithmConfig(oversample=True))
    assert resolve(forced, "cpu").algorithm.oversample is True


def test_oversample_off_is_one_prompt_batch_per_round():
    s, rollout = make_sampler(["mix", "same"] * 50, dataclasses.replace(ALGO, oversample=False))
    _, _, m = s.sample(1)
    assert rollout.calls == [4, 4] and m["rollout/sampling_rounds"] == 2  # 2 kept of 4, then 2 more of 4


def test_surplus_groups_are_a_uniform_draw_not_the_first():
    s, _ = make_sampler(["mix"] * 100, ALGO)  # everything informative: 10 groups for 4 places
    firsts = set()
    for step in range(1, 40):
        s.keep_rate = 0.5
        batch, _, _ = s.sample(step)
        firsts.add(batch.prompt_ids[0][1] % 10)  # position of the first kept prompt in its round
    assert len(firsts) > 3  # not always the round's first prompt


# ----------------------------------------------------------------------------- exploration


def test_next_entropy_coef_hand_values():
    assert next_entropy_coef(0.0, 0.1, 0.3, 0.005, 0.05) == 0.005  # below target: up
    assert next_entropy_coef(0.01, 0.5, 0.3, 0.005, 0.05) == pytest.approx(0.005)  # above: down
    assert next_entropy_coef(0.002, 0.5, 0.3, 0.005, 0.05) == 0.0  # floor 0
    assert next_entropy_coef(0.049, 0.1, 0.3, 0.005, 0.05) == 0.05  # ceiling
    assert next_entropy_coef(0.02, 0.3, 0.3, 0.005, 0.05) == 0.02  # on target: unchanged


def test_entropy_control_feeds_the_update_and_resumes():
    algo = AlgorithmConfig(entropy_coef=0.01)
    off = EntropyControl(algo, ExplorationConfig())
    assert off.algorithm() is algo and off.after_step({"actor/entropy": 0.0}) == {}
    on = EntropyControl(algo, ExplorationConfig(entropy_target=0.5, entropy_coef_step=0.004))
    used = [on.after_step({"actor/entropy": h})["actor/entropy_coef"] for h in (0.2, 0.2, 0.9, 0.3)]
    assert used == pytest.approx([0.01, 0.014, 0.018, 0.014])
    assert on.algorithm().entropy_coef == pytest.approx(0.018) and algo.entropy_coef == 0.01
    other = EntropyControl(algo, ExplorationConfig(entropy_target=0.5))
    other.load_state_dict(on.state_dict())
    assert other.coef == on.coef


def test_entropy_coefficient_reaches_the_gradient():
    """The controller's coefficient is the one the loss uses: the gradient with the controlled
    coefficient equals the gradient with that coefficient set by hand."""
    from tests.test_grpo_options import BASE, run

    control = EntropyControl(dataclasses.replace(BASE, entropy_coef=0.0),
                             ExplorationConfig(entropy_target=5.0, entropy_coef_step=0.3, entropy_coef_max=1.0))
    control.after_step({"actor/entropy": 1.0})  # below target: 0 -> 0.3
    by_hand = run(dataclasses.replace(BASE, entropy_coef=0.3))
    controlled = run(control.algorithm())
    assert torch.equal(by_hand, controlled) and not torch.equal(controlled, run(dataclasses.replace(BASE, entropy_coef=0.0)))


def test_clip_cov_weights_hand_batch():
    # 2 sequences x 3 tokens, the last token of row 1 masked. A = +1 / -1 per row.
    logp = torch.tensor([[-0.1, -2.0, -0.5], [-3.0, -0.2, -9.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # masked means: A = (3 - 2) / 5 = 0.2, logp = (-0.1 - 2 - 0.5 - 3 - 0.2) / 5 = -1.16
    # cov = (A - 0.2) * (logp + 1.16): row 0: 0.8 * (1.06, -0.84, 0.66) = (0.848, -0.672, 0.528)
    #                                  row 1: -1.2 * (-1.84, 0.96) = (2.208, -1.152)
    w, n = advantage.clip_cov_weights(logp, logp, adv, mask, ratio=0.2, low=0.5, high=5.0, clip_low=0.2, clip_high=0.2)
    # band (0.5, 5): tokens (0,0) 0.848, (0,2) 0.528, (1,0) 2.208; max(1, int(0.2 * 5)) = 1 dropped
    assert n == 1 and w.sum() == 5 and w[1, 2] == 1
    assert (w == 0).nonzero().tolist()[0] in ([0, 0], [0, 2], [1, 0])
    w, n = advantage.clip_cov_weights(logp, logp, adv, mask, ratio=0.6, low=0.5, high=5.0, clip_low=0.2, clip_high=0.2)
    assert n == 3 and (w == 0).nonzero().tolist() == [[0, 0], [0, 2], [1, 0]]  # int(0.6 * 5) = 3: all the band
    w, n = advantage.clip_cov_weights(logp, logp, adv, mask, ratio=0.6, low=1.0, high=2.0, clip_low=0.2, clip_high=0.2)
    assert n == 0 and w.eq(1).all()  # nothing in (1, 2)
    # a token the PPO clip already clipped is not drawn: ratio e^1 > 1.2 with A > 0 at (0, 0)
    old = logp.clone()
    old[0, 0] -= 1.0
    w, n = advantage.clip_cov_weights(logp, old, adv, mask, ratio=0.6, low=0.5, high=5.0, clip_low=0.2, clip_high=0.2)
    assert n == 2 and (w == 0).nonzero().tolist() == [[0, 2], [1, 0]]


def test_clip_cov_removes_exactly_the_drawn_tokens_gradient():
    """Through the update: Clip-Cov's gradient equals the gradient with the drawn tokens' loss
    weight set to 0 by hand (the is_weights path TIS uses), and differs from the update without it."""
    from tests.test_grpo_options import BASE, SCORES, FakePolicy, make_batch

    cfg = dataclasses.replace(BASE, kl_loss_coef=0.0, entropy_coef=0.0)
    opts = clip_cov_options(ExplorationConfig(clip_cov_ratio=0.2, clip_cov_lb=-1e9, clip_cov_ub=1e9))

    def update(clip_cov):
        torch.manual_seed(0)
        policy, batch = FakePolicy(), make_batch()
        scores, _ = shape_rewards(SCORES.clone(), batch, cfg, max_response_length=6)
        adv = advantages_for(batch, scores, cfg)
        m = grpo.ppo_update(policy, batch, adv, None, None, cfg, 1.0, 1, "cpu", norm_len=6, clip_cov=clip_cov)
        return policy.grads[0], m

    on, metrics = update(opts)
    off, _ = update(None)
    assert 0 < metrics["actor/clip_cov_frac"] <= 0.25 and not torch.allclose(on, off)
    assert clip_cov_options(ExplorationConfig()) is None


# ----------------------------------------------------------------------------- scripts/bench_learning.py


def test_bench_learning_budget_and_summary():
    """The budget counts training time only and ends at the first validation at or after it; the
    summary's per-validation windows and per-trained-sample generation time are hand-checkable."""
    from scripts import bench_learning as bl

    rows = [{"step": 0, "val/accuracy": 0.1}]
    for s in range(1, 7):  # 30 s steps, half of it generation; 16 samples of 4 tokens trained per step
        rows.append({"step": s, "timing/step_s": 30.0, "timing/generate_s": 15.0, "timing/train_s": 10.0,
                     "rollout/tokens": 64.0, "rollout/response_len_mean": 4.0, "actor/entropy": 1.0 / s,
                     "reward/mean": 0.1 * s, "rollout/zero_variance_groups_frac": 0.5,
                     "rollout/generated_per_trained": 2.0 if s <= 3 else 1.0, "rollout/sampling_rounds": 1.0})
        if s % 3 == 0:
            rows.append({"step": s, "val/accuracy": 0.1 + 0.1 * s})
    assert bl.train_minutes(rows)[4] == 2.0
    assert bl.budget_reached(rows, 3.0)  # 3 min spent at step 6, validated at step 6
    assert not bl.budget_reached(rows[:-1], 3.0)  # spent, but its validation not yet logged
    assert not bl.budget_reached(rows, 3.5)
    r = bl.summarise("x", rows, budget_min=3.0)
    assert r["steps"] == 6 and r["final_accuracy"] == pytest.approx(0.7) and r["accuracy_at_two_thirds"] == 0.4
    assert [v["train_min"] for v in r["validations"]] == [0.0, 1.5, 3.0]
    # last third: the anchor at 1.5 min (0.4) and 3.0 min (0.7), a line through both
    assert r["last_third_rise"] == pytest.approx(0.3)
    flat = [{"step": 0, "train_min": 0.0, "accuracy": 0.1}] + [
        {"step": s, "train_min": m, "accuracy": a}
        for s, m, a in [(1, 20.0, 0.5), (2, 25.0, 0.6), (3, 30.0, 0.4), (4, 34.0, 0.5)]]
    # by hand, anchor 20 min (the last at or before 2/3 of 34): x = 20, 25, 30, 34 (mean 27.25),
    # y = .5, .6, .4, .5 (mean .5);
    # Sxy = (-7.25)(0) + (-2.25)(.1) + (2.75)(-.1) + (6.75)(0) = -0.5;
    # Sxx = 52.5625 + 5.0625 + 7.5625 + 45.5625 = 110.75; rise = -0.5 / 110.75 * 14
    assert bl.last_third_rise(flat, 34.0) == pytest.approx(-0.5 / 110.75 * 14)
    assert bl.last_third_rise(flat[:1], 34.0) is None
    assert r["validations"][1]["entropy"] == pytest.approx((1 + 1 / 2 + 1 / 3) / 3)
    assert r["validations"][2]["gen_per_trained"] == 1.0 and r["gen_per_trained_mean"] == 1.5
    assert r["generate_s_per_trained_sample"] == pytest.approx(15.0 / 16)
    args = bl.parse_args(["--run", "a=--algorithm.oversample false", "--run", "b="])
    assert args.runs == [("a", ["--algorithm.oversample", "false"]), ("b", [])]


def test_bench_learning_breakdown_joins_by_prompt(tmp_path):
    """Per-value accuracy of the logged greedy rows, joined to the data rows by the prompt they
    contain: a templated prompt, a prompt that is a prefix of another, and a row the data lacks."""
    from scripts import bench_learning as bl

    data = [{"prompt": "What is 1 + 2?", "op": "add", "carries": 0},
            {"prompt": "What is 1 + 2? Twice.", "op": "sub", "carries": 1},  # contains the first
            {"prompt": "What is 9 + 9?", "op": "add", "carries": 1}]
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(d) + "\n" for d in data))
    (tmp_path / "run" / "val").mkdir(parents=True)

    def logged(step, prompt, correct):
        return json.dumps({"step": step, "prompt": f"<|user|>\n{prompt}<|end|>\n", "correct": correct}) + "\n"

    (tmp_path / "run" / "val" / "step_5.jsonl").write_text(
        logged(5, "What is 1 + 2?", True) + logged(5, "What is 1 + 2? Twice.", False)
        + logged(5, "What is 9 + 9?", True) + logged(5, "not in the data", True))
    (tmp_path / "run" / "val" / "step_10.jsonl").write_text(logged(10, "What is 9 + 9?", False))
    got = bl.field_accuracy(str(tmp_path / "run"), str(tmp_path / "val.jsonl"), "op,carries")
    assert got == {5: {"?": (1, 1), "add/0": (1, 1), "add/1": (1, 1), "sub/1": (0, 1)}, 10: {"add/1": (0, 1)}}
    assert bl.field_accuracy(str(tmp_path / "run"), str(tmp_path / "val.jsonl"), "op")[5]["add"] == (2, 2)
    with pytest.raises(SystemExit):  # a breakdown needs the data file
        bl.parse_args(["--run", "a=", "--breakdown", "op"])
