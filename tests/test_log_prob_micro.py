"""The no-gradient forwards' own micro-batches (algorithm.log_prob_micro_batch_size and
log_prob_micro_batch_tokens, verl's log_prob_micro_batch_size_per_gpu and
log_prob_max_token_len_per_gpu): how they resolve and split (unit), and through the real FSDP2
engine on 2 ranks in fp32 that the old-policy and reference log-probs, a whole train phase's
metrics and update, and one real trainer step's metrics (train_grpo.py with vLLM) do not depend on
them; the memory plan's count of the no-gradient forward, by hand."""

import math
import os

import pytest
import torch

from conftest import REPO, run_torchrun
from rlcore.algo import grpo
from rlcore.algo.batch import RolloutBatch
from rlcore.algo.log_prob import check_log_prob_tokens, describe_log_prob_micro, log_prob_micro
from rlcore.algo.packing import split_micro
from rlcore.config import AlgorithmConfig
from rlcore.errors import ConfigError

WORKER = os.path.join(REPO, "tests", "workers", "log_prob_micro.py")
LOGP_TOL = 1e-5  # fp32: another packing reorders the sums of the attention and the matmuls (seen: 4.8e-7)
METRIC_RTOL = 1e-4  # a train phase's metrics, relative, plus LOGP_TOL absolute (seen: 3.4e-6 in the worker;
# 3.1e-5 = 2.2e-6 absolute for the trainer's actor/ppo_kl, a mean of differences of near-equal log-probs)
VARIANTS = ("train", "size1", "size2", "size8", "tokens40", "shared+tokens40")  # the worker's
UPDATE_RTOL = 1e-3  # |delta_a - delta_b| / |delta_a| of two AdamW steps (seen: 4.7e-5; AdamW's first
# steps divide by sqrt(v) and magnify the last-bit differences of the old/ref log-probs)


def batch(lengths=(7, 1, 4, 9, 3, 5, 2, 8), prompt_lens=(5, 5, 5, 8, 8, 8, 8, 8)) -> RolloutBatch:
    prompts = [[3 + (n % 4)] * n for n in prompt_lens]
    responses = [[4] * n for n in lengths]
    return RolloutBatch(prompts, responses, [[0.0] * n for n in lengths], ["x"] * len(lengths),
                        ["stop"] * len(lengths), 4)


@pytest.mark.unit
@pytest.mark.parametrize("keys, size, tokens", [
    ({}, 2, None),  # null: the update's micro-batch
    ({"log_prob_micro_batch_size": 8}, 8, None),
    ({"log_prob_micro_batch_tokens": 40}, 2, 40),  # token-budgeted though training is not
    ({"micro_batch_tokens": 30}, 2, 30),  # the update's budget is inherited
    ({"micro_batch_tokens": 30, "log_prob_micro_batch_tokens": 90, "log_prob_micro_batch_size": 6}, 6, 90),
])
def test_log_prob_micro_resolves_each_key_to_the_training_value_when_null(keys, size, tokens):
    cfg = AlgorithmConfig(micro_batch_size=2, **keys)
    lp = log_prob_micro(cfg)
    assert (lp.micro_batch_size, lp.micro_batch_tokens) == (size, tokens)
    assert (lp is cfg) == (not keys or set(keys) == {"micro_batch_tokens"})  # unchanged: the same object
    assert (cfg.micro_batch_size, cfg.micro_batch_tokens) == (2, keys.get("micro_batch_tokens"))  # not modified


@pytest.mark.unit
@pytest.mark.parametrize("size, expect", [(1, [[i] for i in range(8)]), (3, [[0, 1, 2], [3, 4, 5], [6, 7]]),
                                          (8, [list(range(8))]), (32, [list(range(8))])])
def test_split_by_count(size, expect):
    b = batch()
    cfg = log_prob_micro(AlgorithmConfig(micro_batch_size=2, log_prob_micro_batch_size=size))
    assert split_micro(b, list(range(8)), cfg) == expect


@pytest.mark.unit
@pytest.mark.parametrize("budget", [17, 24, 40, 200])
def test_split_by_token_budget(budget):
    """ceil(tokens / budget) micro-batches (the sequences are 6 to 17 tokens), every sequence once, in
    order within a micro-batch, loads within one sequence of each other (longest first to the lightest)."""
    b = batch()
    lengths = [len(p) + len(r) for p, r in zip(b.prompt_ids, b.response_ids)]  # 12, 6, 9, 17, 11, 13, 10, 16
    parts = split_micro(b, list(range(8)), log_prob_micro(AlgorithmConfig(log_prob_micro_batch_tokens=budget)))
    assert len(parts) == min(8, math.ceil(sum(lengths) / budget))
    assert sorted(i for p in parts for i in p) == list(range(8)) and all(p == sorted(p) for p in parts)
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(lengths)


@pytest.mark.unit
def test_shared_prompt_budget_keeps_a_prompt_run_whole():
    b = batch()  # runs: samples 0-2 (prompt 5), 3-7 (prompt 8); shared: 5 + 12 and 8 + 27 tokens
    cfg = log_prob_micro(AlgorithmConfig(share_prompt=True, log_prob_micro_batch_tokens=40))
    assert sorted(split_micro(b, list(range(8)), cfg)) == [[0, 1, 2], [3, 4, 5, 6, 7]]


@pytest.mark.unit
def test_longest_sequence_check():
    check_log_prob_tokens(AlgorithmConfig(), 100)  # null: nothing to check
    check_log_prob_tokens(AlgorithmConfig(log_prob_micro_batch_tokens=100), 100)
    with pytest.raises(ConfigError, match=r"algorithm.log_prob_micro_batch_tokens=99 .*raise it to at least 100"):
        check_log_prob_tokens(AlgorithmConfig(log_prob_micro_batch_tokens=99), 100)


@pytest.mark.unit
@pytest.mark.parametrize("key", ["log_prob_micro_batch_size", "log_prob_micro_batch_tokens"])
def test_non_positive_values_are_refused(key):
    with pytest.raises(ConfigError, match=f"algorithm.{key}=0 is invalid: it must be > 0"):
        AlgorithmConfig(**{key: 0})


@pytest.mark.unit
def test_start_up_line_names_the_no_gradient_micro_batches():
    assert describe_log_prob_micro(AlgorithmConfig()) == ""
    line = grpo.describe_train_phase(AlgorithmConfig(share_prompt=False, log_prob_micro_batch_size=32))
    assert line.endswith("micro-batches of 8 sequences, old/ref log-prob micro-batches of 32 sequences"), line
    assert "old/ref log-prob micro-batches up to 4096 tokens" in grpo.describe_train_phase(
        AlgorithmConfig(share_prompt=False, log_prob_micro_batch_tokens=4096))


@pytest.fixture(scope="module")
def ranks(tiny_model, tmp_path_factory):
    """Each rank's results of tests/workers/log_prob_micro.py on 2 ranks."""
    out = tmp_path_factory.mktemp("log_prob_micro") / "out.pt"
    run_torchrun(WORKER, 2, tiny_model, str(out))
    return torch.load(out, weights_only=False)


def test_old_and_reference_logprobs_do_not_depend_on_the_log_prob_micro_batch(ranks):
    for rank, res in enumerate(ranks):
        mask = res["mask"]
        # the policy trained: its log-probs are not the reference's, so the two are told apart
        assert ((res["old/train"] - res["ref/train"]).abs() * mask).max() > 0.1
        # the splits really differ: 4 samples per rank, training micro-batch 2
        assert {n: int(res[f"forwards/{n}"]) for n in VARIANTS} == {
            "train": 2, "size1": 4, "size2": 2, "size8": 1, "tokens40": 2, "shared+tokens40": 1}
        for kind in ("old", "ref"):
            base = res[f"{kind}/train"]
            for name in VARIANTS[1:]:
                diff = ((res[f"{kind}/{name}"] - base).abs() * mask).max().item()
                assert diff <= LOGP_TOL, f"rank {rank} {kind} {name}: max |log-prob difference| {diff:.2e}"


def test_a_train_phase_is_the_same_with_larger_log_prob_micro_batches(ranks):
    res = ranks[0]
    keys = [k for k in res if k.startswith("step/train/") and not k.endswith("/params")]
    assert {"step/train/actor/kl", "step/train/actor/pg_loss", "step/train/actor/grad_norm"} <= set(keys)
    assert res["step/train/actor/kl"] > 0.01  # the reference log-probs are used
    for k in keys:
        a, b = res[k].item(), res[k.replace("step/train/", "step/size8/")].item()
        assert abs(a - b) <= METRIC_RTOL * abs(a) + LOGP_TOL, f"{k}: {a} vs {b}"
    delta_a = res["step/train/params"] - res["init/params"]
    delta_b = res["step/size8/params"] - res["init/params"]
    assert delta_a.norm() > 0
    rel = ((delta_a - delta_b).norm() / delta_a.norm()).item()
    assert rel <= UPDATE_RTOL, f"updates differ by {rel:.2e} (relative)"


@pytest.mark.unit
def test_memory_plan_counts_the_no_gradient_forward_at_its_own_micro_batch():
    """Qwen3-8B (tests/fixtures/qwen3_8b) in bf16 with gradient checkpointing, 8 ranks, 8 sequences
    of 256 + 64 tokens per rank, training micro-batch 1: by hand, the no-gradient forward of 8
    sequences (T' = 2560) outweighs the update's activations of one (T = 320) and becomes the train
    phase's activations; with the keys unset the update's stay (the no-gradient term is smaller)."""
    import dataclasses

    from rlcore.plan.inputs import PlanInputs
    from rlcore.plan.memory import activation_bytes, build_plan, no_grad_activation_bytes
    from rlcore.plan.model_shape import ModelShape

    shape = ModelShape.from_path(os.path.join(REPO, "tests", "fixtures", "qwen3_8b"))
    p = PlanInputs(shape=shape, world=8, device_gb=80, dtype="bfloat16", gradient_checkpointing=True,
                   micro_batch_size=1, prompt_len=256, response_len=64, prompts_per_step=8, n=8)
    layer = 4 * 4096 + 2 * (4096 + 2 * 1024) + 4096 + 4 * 12288  # saved elements per token of a layer
    t = 320
    train = 36 * t * 4096 * 2 + 2 * t * layer * 2 + 2 * t * 4096 * 2 + 6 * t * 151936 * 4
    assert activation_bytes(p) == train
    assert build_plan(p).phases["train"]["activations"] == train  # unset: the update's micro-batch
    big = dataclasses.replace(p, log_prob_micro_batch_size=8)
    t = 8 * 320
    no_grad = 2 * t * 4096 * 2 + t * layer * 2 + t * 4096 * 2 + 2 * 1024 * 151936 * 4
    assert no_grad_activation_bytes(big) == no_grad > train
    assert build_plan(big).phases["train"]["activations"] == no_grad
    assert dataclasses.replace(p, log_prob_micro_batch_size=64).log_prob_micro_tokens == 2560  # what a rank holds
    assert dataclasses.replace(p, log_prob_micro_batch_tokens=1000).log_prob_micro_tokens == 1000 + 320


@pytest.fixture(scope="module")
def trainer_runs(tiny_model, toy_data, tmp_path_factory):
    """One real trainer step (train_grpo.py, 2 ranks, vLLM sampling, the reference model, two
    mini-batches so the old log-probs are recomputed) without and with the no-gradient keys."""
    import json

    from test_e2e import read_metrics, train

    out = {}
    common = ("--trainer.total_steps", "1", "--algorithm.kl_loss_coef", "0.1", "--algorithm.mini_batches", "2",
              "--algorithm.entropy_coef", "0.01",  # a gradient whatever the rewards: the 2nd mini-batch has moved
              "--algorithm.micro_batch_size", "1", "--checkpoint.save_every", "-1", "--checkpoint.save_hf_final",
              "false")
    for name, extra in (("train", ()), ("log_prob", ("--algorithm.log_prob_micro_batch_size", "8"))):
        folder = str(tmp_path_factory.mktemp(f"run_{name}"))
        proc = train(2, tiny_model, toy_data[0], folder, 1, *common, *extra)
        out[name] = (read_metrics(folder)[0], proc.stdout)
    json.dumps(out["train"][0])  # plain numbers
    return out


def test_a_trainer_step_logs_the_same_metrics_with_larger_log_prob_micro_batches(trainer_runs):
    (base, base_out), (lp, lp_out) = trainer_runs["train"], trainer_runs["log_prob"]
    assert "old/ref log-prob micro-batches of 8 sequences" in lp_out and "old/ref log-prob" not in base_out
    assert base["actor/kl"] > 1e-9 and base["actor/grad_norm"] > 0  # the reference and the update really ran
    wall = ("timing/", "memory/", "perf/")  # wall-clock and memory: not the algorithm's numbers
    keys = [k for k, v in base.items() if isinstance(v, (int, float)) and not k.startswith(wall)]
    assert set(keys) <= set(lp), set(keys) - set(lp)
    for k in keys:
        assert abs(base[k] - lp[k]) <= METRIC_RTOL * abs(base[k]) + LOGP_TOL, f"{k}: {base[k]} vs {lp[k]}"
    worst = max(keys, key=lambda k: abs(base[k] - lp[k]))
    print(f"{len(keys)} metrics; largest difference {worst}: {base[worst]} vs {lp[worst]}; actor/kl {base['actor/kl']}")
