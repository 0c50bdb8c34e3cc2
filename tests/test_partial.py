"""Partial rollouts (rlcore/step/partial.py): the pool's logic against a scripted engine (unit), the
correction weights of mixed-version tokens against a plain-PyTorch reference (unit), and the real
engine under torchrun (tests/workers/partial_worker.py): a resumed sequence's trained ids and
behaviour log-probs are exactly what vLLM returned in each step. Kill -9 and preemption with
suspended groups in the checkpoint are in tests/test_resume.py."""

from __future__ import annotations

import dataclasses
import json
import os
import types

import pytest
import torch

from conftest import REPO, run_torchrun

WORKER = os.path.join(REPO, "tests", "workers", "partial_worker.py")


class ScriptedEngine:
    """generate() as ColocateRollout's: a prompt [L, a, b] has responses of L tokens (ids 100, 101, ...,
    the last one EOS-like: finish "stop"), each token's log-prob names the policy version and position;
    every call is recorded."""

    tp_size, dp_size, dp_rank = 1, 1, 0

    def __init__(self):
        self.version, self.calls = 0, []

    def generate(self, prompts, *, n, temperature, top_p, top_k, max_tokens, seed):
        out = []
        for p in prompts:
            total, done = p[0], len(p) - 3
            ids = [100 + done + i for i in range(min(max_tokens, total - done))]
            lps = [-(self.version + 1) - 0.01 * (done + i) for i in range(len(ids))]
            finish = "stop" if done + len(ids) == total else "length"
            out.append([types.SimpleNamespace(response_ids=ids, logprobs=lps, finish_reason=finish)])
        self.calls.append((self.version, [list(p) for p in prompts], out))
        return out


def sampler(lengths: list[int], target: int, oversample: float, chunk: int, max_staleness: int = 2, n: int = 2,
            informative: set | None = None, max_rounds: int = 1):
    """``informative``: with it, dynamic sampling on, and the groups of these prompt indices have
    rewards 0, 1, ... (the others all 1: filtered)."""
    from rlcore.config import PartialConfig, RolloutConfig
    from rlcore.metrics import Timer
    from rlcore.step.partial import PartialRollouts
    from rlcore.task.prompts import Prompt

    queue = [Prompt(ids=[length, 7, 8], text=f"p{i}", answer=str(i), row={"i": i}) for i, length in enumerate(lengths)]
    cfg = RolloutConfig(n=n, max_response_length=16, max_model_len=64)
    s = types.SimpleNamespace(per_replica=lambda: target, cfg=cfg, switch=None, timer=Timer(), seed=0,
                              rollout=ScriptedEngine())
    s.next_prompts = lambda k: [queue.pop(0) for _ in range(k)]
    s.scored, s.decoded = [], []
    s.count_decode = s.decoded.append
    s.score = lambda b, collective=True: (s.scored.append([int(a) for a in b.answers[::n]]) or torch.tensor(
        [float(j % n) if int(a) in informative else 1.0 for j, a in enumerate(b.answers)]), {})
    part = PartialRollouts(PartialConfig(enable=True, chunk_tokens=chunk, oversample=oversample,
                                         max_staleness=max_staleness), n, cfg.max_response_length,
                           dynamic=informative is not None, max_rounds=max_rounds)
    return s, part


@pytest.mark.unit
def test_without_oversampling_a_step_waits_for_every_group_in_chunks():
    s, part = sampler([5, 2, 9, 1], target=2, oversample=1.0, chunk=3)
    batch, m = part.sample(s, step=1)
    assert [p[0] for p in batch.prompt_ids[::2]] == [5, 2] and part.pool == []
    assert batch.response_ids[0] == [100, 101, 102, 103, 104] and m["rollout/chunks"] == 2.0  # 5 tokens: 3 + 2
    assert m["rollout/partial_frac"] == 0.0 and m["rollout/staleness_max"] == 0.0


@pytest.mark.unit
def test_the_early_stop_suspends_stragglers_and_resumes_them_token_exact():
    """Target 2 groups of 4 in flight: the short ones train at step 1; the 9-token group continues at
    step 2 under the next policy version: its ids are the concatenation of what each call returned,
    each token with the log-prob and the version of the call that sampled it."""
    s, part = sampler([9, 2, 3, 12, 1, 2, 1, 1], target=2, oversample=2.0, chunk=4)
    batch, m = part.sample(s, step=1)
    assert sorted(p[0] for p in batch.prompt_ids[::2]) == [2, 3]  # the first two groups to finish
    assert m["rollout/suspended_groups"] == 2.0 and m["rollout/partial_len_bias"] < 1.0
    s.rollout.version = 1  # one update later: the suspended groups grow, two new short ones train
    batch, m = part.sample(s, step=2)
    assert sorted(p[0] for p in batch.prompt_ids[::2]) == [1, 2] and m["rollout/partial_frac"] == 0.0
    s.rollout.version = 2
    batch, m = part.sample(s, step=3)
    assert [p[0] for p in batch.prompt_ids[::2]] == [9, 12]  # done with two new ones: the oldest train
    # 4 tokens sampled at version 0 (step 1's one chunk), 4 at version 1, 1 at version 2
    i = batch.prompt_ids.index([9, 7, 8])
    assert batch.response_ids[i] == list(range(100, 109))
    assert batch.rollout_logp[i] == pytest.approx([-1 - 0.01 * j for j in range(4)] + [-2 - 0.01 * j for j in range(4, 8)]
                                                  + [-3 - 0.08])
    assert batch.staleness[i] == [2, 2, 2, 2, 1, 1, 1, 1, 0]
    continued = [p for _, prompts, _ in s.rollout.calls[1:] for p in prompts if p[0] == 9][::2]  # n = 2: twice
    assert continued[:2] == [[9, 7, 8, 100, 101, 102, 103], [9, 7, 8, *range(100, 108)]]  # re-prefilled each step
    assert m["rollout/partial_frac"] == 1.0 and m["rollout/staleness_max"] == 2.0


@pytest.mark.unit
def test_stale_groups_are_dropped_and_counted_and_the_pool_survives_a_checkpoint():
    s, part = sampler([12, 1, 1, 14, 1, 1, 1, 1], target=2, oversample=2.0, chunk=2, max_staleness=0)
    part.sample(s, step=1)
    assert [g.prompt.ids[0] for g in part.pool] == [12, 14]  # suspended with version-0 tokens
    state = json.loads(json.dumps(part.state_dict()))  # plain data: what the checkpoint holds
    again = sampler([], 2, 2.0, 2, max_staleness=0)[1]
    again.load_state_dict(state)
    assert [(g.prompt.ids, g.start, [x.ids for x in g.seqs]) for g in again.pool] == \
        [(g.prompt.ids, g.start, [x.ids for x in g.seqs]) for g in part.pool]
    s.rollout.version = 1
    _, m = part.sample(s, step=2)  # max_staleness 0: their version-0 tokens would train at version 1
    assert m["rollout/dropped_stale"] == 2.0 and m["rollout/staleness_max"] == 0.0


@pytest.mark.unit
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_correction_weights_of_mixed_version_tokens_equal_a_hand_computation(level):
    """A resumed sequence's first tokens were sampled by an older policy: rollout correction weighs each
    token by exp(old - its own behaviour log-prob), written out here with plain PyTorch."""
    from rlcore.algo.rollout_correction import correct

    behaviour = torch.tensor([[-1.0, -1.2, -0.7, -0.9], [-0.5, -0.6, 0.0, 0.0]])  # (N, T): 2 old + 2 fresh tokens
    old = torch.tensor([[-1.3, -1.0, -0.7, -0.95], [-0.5, -0.4, 0.0, 0.0]])  # the trainer's, before the update
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    corr, _ = correct(old, behaviour, mask, is_level=level, is_mode="truncate", is_low=0.0, is_high=2.0,
                      rs=None, rs_threshold=None, rs_low=None)
    log_rho = (old - behaviour) * mask
    if level == "token":
        ref = torch.exp(log_rho).clamp(max=2.0)
    else:
        ref = torch.exp(log_rho.sum(-1, keepdim=True)).clamp(max=2.0).expand_as(log_rho)
    assert torch.allclose(corr.weights * mask, ref * mask, atol=1e-7)
    assert corr.weights[0, 0].item() == pytest.approx(float(torch.exp(torch.tensor(-0.3))) if level == "token"
                                                      else float(torch.exp(torch.tensor(-0.15))), rel=1e-6)


@pytest.mark.unit
def test_the_memory_plan_counts_the_groups_in_flight_and_the_suspended_state():
    """Over-sampling puts oversample x the trained groups into each generate call (the KV cache the
    plan sizes), and leaves up to (oversample - 1) x groups x n sequences suspended in host memory;
    the bytes per token the plan assumes bound those of a real pool (tracemalloc)."""
    import tracemalloc

    from rlcore.plan.judges import SUSPENDED_TOKEN_BYTES, suspended_sequences
    from rlcore.plan.inputs import PlanInputs
    from rlcore.plan.memory import build_plan, format_plan
    from rlcore.plan.model_shape import ModelShape
    from rlcore.step.partial import Seq

    shape = ModelShape.from_path(os.path.join(REPO, "tests", "fixtures", "qwen3_8b"))
    base = PlanInputs(shape, world=16, device_gb=80, tp=2, prompts_per_step=64, n=8, response_len=4096,
                      max_model_len=8192)
    over = PlanInputs(**{**base.__dict__, "oversample": 1.5})
    plain, partial = build_plan(base, suggest=False), build_plan(over, suggest=False)
    assert plain.kv["batch_sequences"] == 64 // 8 * 8 and partial.kv["batch_sequences"] == 96  # 12 groups of 8
    assert partial.kv["batch_tokens"] == 96 * over.seq_len and partial.phases == plain.phases
    assert suspended_sequences(base) == 0 and suspended_sequences(over) == 4 * 8  # ceil(1.5 x 8) - 8 groups
    text = format_plan(partial)
    gb = 32 * 4096 * SUSPENDED_TOKEN_BYTES / 2**30
    assert f"suspended rollouts: up to 32 sequences x 4096 tokens = {gb:.2f} GB host memory per rank" in text
    assert "suspended rollouts" not in format_plan(plain)

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    pool = [Seq() for _ in range(32)]
    for version in range(100, 103):  # three steps' chunks, as the loop appends them
        for s in pool:
            for t in range(512):
                s.ids.append(151_000 - 7 * t - version)
                s.logprobs.append(-0.001 * t - version)
                s.versions.append(version)
    measured = (tracemalloc.get_traced_memory()[0] - before) / (32 * 3 * 512)
    tracemalloc.stop()
    print(f"suspended state: {measured:.1f} B per token (the plan assumes {SUSPENDED_TOKEN_BYTES})")
    assert SUSPENDED_TOKEN_BYTES / 1.6 < measured <= SUSPENDED_TOKEN_BYTES


@pytest.mark.unit
def test_dynamic_sampling_filters_finished_groups_and_refills_the_pool():
    """Target 2, in flight 2, prompts 0 and 2 informative: prompt 1 finishes first, all rewards equal,
    and leaves the pool; the refill starts prompt 2 (round 2), which trains with prompt 0. Each group
    is scored once, when it finishes."""
    s, part = sampler([2, 3, 1, 4], target=2, oversample=1.0, chunk=4, informative={0, 2}, max_rounds=3)
    batch, m = part.sample(s, step=1)
    assert [int(a) for a in batch.answers[::2]] == [0, 2] and batch.keep == [1.0] * 4
    assert sorted(i for call in s.scored for i in call) == [0, 1, 2]  # prompt 3 was never drawn
    assert m["rollout/filtered_groups_frac"] == pytest.approx(1 / 3) and m["rollout/sampling_rounds"] == 2.0
    assert m["rollout/generated_per_trained"] == pytest.approx(1.5) and part.pool == []


@pytest.mark.unit
def test_dynamic_sampling_pads_with_filtered_groups_masked_once_the_rounds_are_used_up():
    s, part = sampler([2, 3, 1, 4, 2, 2], target=2, oversample=1.0, chunk=4, informative={3}, max_rounds=2)
    batch, m = part.sample(s, step=1)
    # round 1: prompts 0, 1 (both filtered); round 2 (the last): prompts 2 (filtered) and 3 (trained)
    assert [int(a) for a in batch.answers[::2]] == [3, 0] and batch.keep == [1.0, 1.0, 0.0, 0.0]
    assert m["rollout/sampling_rounds"] == 2.0 and m["rollout/filtered_groups_frac"] == pytest.approx(3 / 4)
    state = part.state_dict()
    assert state == [] and len(s.rollout.calls) == 2


@pytest.mark.unit
def test_the_pool_state_is_a_copy_that_the_next_step_does_not_change():
    """The loop snapshots the sampler's state at each step's start (what a preemption saves when it
    abandons the step): the step's growth of the suspended sequences must not reach into it."""
    import copy

    s, part = sampler([9, 2, 3, 12, 1, 2, 1, 1], target=2, oversample=2.0, chunk=4)
    part.sample(s, step=1)
    snapshot = part.state_dict()
    frozen = copy.deepcopy(snapshot)
    assert any(seq["ids"] for g in snapshot for seq in g["seqs"])  # suspended sequences with tokens
    part.sample(s, step=2)
    assert snapshot == frozen


@pytest.mark.unit
def test_tail_iterations_count_what_the_longest_tenth_costs_a_step():
    from rlcore.step.sampling import tail_iterations

    assert tail_iterations([list(range(1, 11))]) == (1.0, 10.0)  # 1 of 10 left for the last iteration
    assert tail_iterations([[40] * 18 + [200, 256]]) == (256.0 - 40.0, 256.0)  # 2 of 20 long: 216 for them
    # In chunks of 64: the first call waits for nobody; the second holds 2 of the step's 20 sequences
    # (the tail's share): all its 64 iterations are theirs; so are the third's 64 (1 left).
    assert tail_iterations([[64] * 20, [64, 64], [64]]) == (128.0, 192.0)
    assert tail_iterations([[5]]) == (0.0, 5.0) and tail_iterations([]) == (0.0, 0.0)
    s, part = sampler([5, 2, 9, 1], target=2, oversample=1.0, chunk=3)
    part.sample(s, step=1)
    assert s.decoded == [[3, 3, 2, 2], [2, 2]]  # two groups of 2 (5 and 2 tokens) in chunks of 3


@pytest.mark.unit
@pytest.mark.parametrize("partial,correction,expect", [
    (True, {}, "token"), (True, {"is_level": "off"}, None), (True, {"is_level": "geometric"}, "geometric"),
    (True, {"tis_cap": 2.0}, None), (False, {}, None)])
def test_partial_rollouts_default_to_token_level_correction(partial, correction, expect):
    from rlcore.config import Config, PartialConfig, RolloutConfig, RolloutCorrectionConfig
    from rlcore.config.resolve import resolve

    cfg = resolve(Config(rollout=RolloutConfig(partial=PartialConfig(enable=partial)),
                         rollout_correction=RolloutCorrectionConfig(**correction)), "cpu")
    options = cfg.rollout_correction.options()
    assert (options or {}).get("is_level") == expect
    assert resolve(cfg, "cpu") == cfg  # resolving twice changes nothing


@pytest.mark.unit
def test_partial_rollouts_refuse_what_they_do_not_support():
    from rlcore.config import AlgorithmConfig, Config, PartialConfig, RewardConfig, RolloutConfig
    from rlcore.config.resolve import check_partial
    from rlcore.errors import ConfigError

    with pytest.raises(ConfigError, match=r"rollout\.partial\.oversample.*>= 1"):
        PartialConfig(enable=True, oversample=0.5)
    cfg = Config(rollout=RolloutConfig(partial=PartialConfig(enable=True)),
                 algorithm=AlgorithmConfig(routing_replay="r3"))
    with pytest.raises(ConfigError, match=r"algorithm\.routing_replay='r3'.*text prompts without routing replay"):
        check_partial(cfg)
    check_partial(dataclasses.replace(cfg, algorithm=AlgorithmConfig(dynamic_sampling=True)))  # supported
    judged = dataclasses.replace(cfg, algorithm=AlgorithmConfig(dynamic_sampling=True),
                                 reward=RewardConfig(components={"rm": 1.0}, models=[{"name": "rm", "path": "/m", "kind": "discriminative"}]))
    with pytest.raises(ConfigError, match=r"dynamic_sampling=true and reward\.models=\['rm'\].*rule-based"):
        check_partial(judged)


def test_resumed_sequences_are_what_vllm_returned_in_each_step(tiny_model, tmp_path):
    """The real engine, one engine sharded over 2 ranks (tp=2): 4 steps of partial rollouts with a
    weight update between steps (the engine's weights perturbed, as a sync would change them); on
    each rank every trained sequence's ids and log-probs equal the concatenation of what vLLM
    returned for it, call by call; and the TP group's two ranks suspended, resumed and trained the
    same sequences (their pools move in step: one early-stop decision, the same outputs). Dynamic
    sampling on (rewards: each sample's length parity): every trained group is informative, and the
    filter removed some."""
    from rlcore.demo.tool import make_chatml_tool_model

    chatml = make_chatml_tool_model(str(tmp_path / "chatml"), os.path.join(REPO, "configs", "chat_templates", "qwen3.jinja"))
    out = str(tmp_path / "partial.json")
    run_torchrun(WORKER, 2, tiny_model, out, "2", chatml)
    ranks = []
    for rank in (0, 1):
        with open(f"{out}.rank{rank}") as f:
            ranks.append(json.load(f))
    for m in ranks:
        assert m["resumed_samples"] > 0, m  # some trained sequence spans two steps
        assert m["mismatched"] == [], m["mismatched"][:3]
        assert m["max_staleness_seen"] >= 1
        assert m["kept_informative"] and all(m["kept_informative"]), m["kept_informative"]
        assert any(s["rollout/filtered_groups_frac"] > 0 for s in m["metrics"]), m["metrics"]
    assert ranks[0]["trained_ids"] == ranks[1]["trained_ids"] and ranks[0]["pool_left"] == ranks[1]["pool_left"]
    assert ranks[0]["metrics"] == ranks[1]["metrics"]
    agents = []
    for rank in (0, 1):
        with open(f"{out}.agent.rank{rank}") as f:
            agents.append(json.load(f))
    check_suspended_conversations(agents[0])
    assert agents[0]["trained"] == agents[1]["trained"]  # the TP group's ranks: one pool, the leader's tool answers


def check_suspended_conversations(run: dict) -> None:
    """Multi-turn partial rollouts on the real engine (chunks of 2 tokens): each trained conversation
    is its prompt, then model spans that are exactly what vLLM returned call by call (ids and
    log-probs, env_mask 1), each call continuing from the conversation so far, and tool answers
    between them (env_mask 0); turns spanned chunks and steps, and tools answered between steps."""
    calls = [c for call in run["calls"] for c in call]  # (context, ids, logprobs) of every request
    inside, across_steps, between = 0, 0, 0
    for conv in run["trained"]:
        seq, p = conv["prompt_ids"] + conv["response_ids"], len(conv["prompt_ids"])
        pos, mask, spans = p, conv["env_mask"], 0
        while pos < len(seq):
            if not mask[pos - p]:
                pos += 1
                continue
            end = next((i + p for i in range(pos - p, len(mask)) if not mask[i]), len(seq))  # the model span
            match = [(ids, lp) for ctx, ids, lp in calls if ctx == seq[:pos] and ids and ids[:end - pos] ==
                     seq[pos:pos + len(ids[:end - pos])]]
            assert match, (conv, pos)
            ids, lp = match[0]
            k = min(len(ids), end - pos)
            assert conv["logprobs"][pos - p: pos - p + k] == lp[:k]
            pos, spans = pos + k, spans + 1
        v, m = conv["versions"], mask
        assert len(v) == len(m) == len(conv["staleness"])
        inside += spans > conv["turns"]  # some turn took more than one generate call
        across_steps += v[0] != v[-1]
        between += any(m[i] == 0 and m[i + 1] == 1 and v[i] < v[i + 1] for i in range(len(m) - 1))
    assert max(c["turns"] for c in run["trained"]) >= 2 and any(0 in c["env_mask"] for c in run["trained"])
    assert inside > 0 and across_steps > 0 and between > 0, (inside, across_steps, between)
    assert run["state_round_trip"] is True


def partial_args(model, data, out, *extra):
    return ["--config", os.path.join(REPO, "configs", "demo_cpu.yaml"), "--model.path", model,
            "--data.train_files", json.dumps([data]), "--data.val_files", "[]", "--trainer.output_dir", out,
            "--trainer.total_steps", "4", "--trainer.prompts_per_step", "4", "--rollout.n", "4",
            "--rollout.max_response_length", "8", "--rollout.partial.enable", "true",
            "--rollout.partial.chunk_tokens", "3", "--rollout.partial.oversample", "2",
            "--rollout_correction.is_level", "token",  # resumed tokens weighed by their own behaviour log-probs
            "--algorithm.micro_batch_tokens", "96",  # token-budget micro-batches; shared prompts: on (sdpa)
            "--checkpoint.keep_last", "10", "--checkpoint.save_hf_final", "false", *extra]


def test_kill9_with_suspended_groups_then_resume_is_exact(tiny_model, toy_data, tmp_path):
    """2 ranks, 4 steps of partial rollouts (2 groups trained per rank and step, 4 in flight), against
    the same run killed (-9) after step 2's checkpoint (suspended groups inside it) and step 3's row,
    resumed, preempted in step 4 (step_3 saved from the step's start) and resumed again: every metric
    row equal, including the staleness and the resumed tokens' mismatch."""
    from workers.launch import TRAIN, comparable, kill9_when, preempt_at, rank_exit_codes, read_rows

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    straight = run_torchrun(TRAIN, 2, *partial_args(tiny_model, toy_data[0], a))
    assert "one prompt per group (block mask), micro-batches up to 96 tokens" in straight.stdout, straight.stdout
    b_args = partial_args(tiny_model, toy_data[0], b, "--checkpoint.save_every", "2", "--checkpoint.resume", "auto")
    kill9_when(2, b_args, r"saved checkpoint .*step_2$", r"^step +3/")
    # Resumed from step_2, then preempted in step 4's generation: step 4 is abandoned and step_3 is
    # written from the snapshot taken at step 4's start, the pool as it was before step 4 grew it.
    preempted = preempt_at(2, b_args, 4)
    assert rank_exit_codes(preempted) == {0: 75, 1: 75}, preempted[-3000:]
    proc = run_torchrun(TRAIN, 2, *b_args)
    assert "resumed from" in proc.stdout and "step_3 at step 3" in proc.stdout, proc.stdout[-2000:]
    rows_a, rows_b = read_rows(a), read_rows(b)
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]
    for ra, rb in zip(rows_a, rows_b):
        assert comparable(ra) == comparable(rb), ra["step"]
    state = torch.load(os.path.join(b, "checkpoints", "step_2", "extra_state", "extra_state_rank_0.pt"),
                       weights_only=True)["user"]["trainer"]["sampling"]["partial"]
    assert len(state) == 2 and all(len(g["seqs"]) == 4 for g in state)  # 4 in flight - 2 trained, carried over
    assert any(r["rollout/partial_frac"] > 0 and r["rollout/staleness_max"] >= 1 for r in rows_a), rows_a
    assert all("rollout/mismatch_kl_resumed" in r and "rollout/mismatch_kl_fresh" in r for r in rows_a[1:])


def test_multi_turn_conversations_suspend_through_the_trainer(tmp_path):
    """train_grpo.py on 2 ranks: the tool demo's model and prompts with a plain tool (the calculator:
    its lookup calls get an error answer and another turn), partial rollouts with 2 x the groups in
    flight, chunks of 2 tokens (a turn is 3). Suspended conversations carry into later steps and
    into step 2's checkpoint as plain data; the conversation metrics are logged as without them."""
    from rlcore.demo.tool import make_tool_data, make_tool_model
    from workers.launch import TRAIN, read_rows

    model = make_tool_model(str(tmp_path / "model"))
    data, _ = make_tool_data(str(tmp_path / "data"), n_train=64, n_val=8)
    out = str(tmp_path / "out")
    run_torchrun(TRAIN, 2, "--config", os.path.join(REPO, "configs", "demo_tool_cpu.yaml"), "--model.path", model,
                 "--data.train_files", json.dumps([data]), "--data.val_files", "[]", "--trainer.output_dir", out,
                 "--trainer.total_steps", "3", "--trainer.prompts_per_step", "4", "--rollout.n", "4",
                 "--trainer.val_before_train", "false", "--trainer.val_every", "0", "--env.cls", "null", "--tools", '["calculator"]',
                 "--reward.components", '{"first_word_match": 1.0}', "--rollout.partial.enable", "true",
                 "--rollout.partial.chunk_tokens", "2", "--rollout.partial.oversample", "2",
                 "--checkpoint.save_every", "2", "--checkpoint.keep_last", "5")
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert any(r["rollout/partial_frac"] > 0 for r in rows[1:]) and rows[0]["rollout/chunks"] >= 2, rows
    assert max(r["rollout/turns_mean"] for r in rows) > 1 and max(r["rollout/tool_calls_mean"] for r in rows) > 0
    state = torch.load(os.path.join(out, "checkpoints", "step_2", "extra_state", "extra_state_rank_0.pt"),
                       weights_only=True)["user"]["trainer"]["sampling"]["partial"]
    convs = [c for g in state for c in g["seqs"]]
    assert len(state) == 2 and all({"messages", "env_mask", "versions", "turn_start"} <= set(c) for c in convs)
    assert any(c["response_ids"] for c in convs)  # suspended with tokens: inside or between turns
