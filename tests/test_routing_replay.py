"""R2 routing replay through the real engine (tests/workers/routing_replay.py): on a tiny
Qwen3-MoE at EP 1 and 2, every replayed token reaches the experts with exactly the recorded
indices, and the replayed log-probs equal transformers' forward forced to those experts."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import REPO, run_torchrun

WORKER = os.path.join(REPO, "tests", "workers", "routing_replay.py")


@pytest.fixture(scope="module")
def tiny_moe_8(tmp_path_factory) -> str:
    """8 experts, top-2: enough experts that one large step changes some tokens' routing."""
    from rlcore.demo.toy import make_tiny_moe_model

    return make_tiny_moe_model(str(tmp_path_factory.mktemp("tiny_moe_8")), num_experts=8)


@pytest.mark.parametrize("world", [1, 2])
def test_r2_replays_the_recorded_experts_exactly(tiny_moe_8, tmp_path, world):
    out = tmp_path / "replay.pt"
    run_torchrun(WORKER, world, tiny_moe_8, str(out))
    r = torch.load(out, weights_only=False)
    print(f"EP {world}: {r}")
    assert r["tokens"] > 0 and r["mismatched"] == 0  # bit-exact indices at every experts call
    assert r["routing"]["actor/router_replay_missing"] == 0
    # the step moved the routers: some native choices differ, so replay had something to do
    assert 0 < r["routing"]["actor/router_agreement"] < 1
    assert r["replay_effect"] > 1e-4
    # transformers forced to the recorded experts: the same experts, other kernels; fp32 summation
    # order only (1.05e-5 measured once on the AMD machine, 1e-5 was too tight), far below the effect
    assert r["diff_forced"] <= 3e-5 < 1e-3 * r["replay_effect"]
    per_layer = [r["routing"][f"debug/router_agreement_layer{i}"] for i in range(r["layers"])]
    assert all(0 <= a <= 1 for a in per_layer)


@pytest.mark.unit
def test_token_keys_name_the_same_tokens_however_packed():
    """Shared-prompt packing and a prompt copy per sample give each position the same key: one
    key per (sample, response position), one per (group, prompt position); selected sub-batches
    keep their samples' keys."""
    from rlcore.algo import batch as rollout_batch, packing

    prompts = [[5, 6, 7]] * 3 + [[8, 9]] * 2
    responses = [[1, 2], [3], [4, 5, 6], [7, 8], [9]]
    batch = rollout_batch.RolloutBatch(prompts, responses, [[0.0] * len(r) for r in responses], ["x"] * 5, ["stop"] * 5, 3)
    assert batch.gids == [0, 0, 0, 1, 1]

    def keyed(b, share):
        packed = packing.pack(b.prompt_ids, b.response_ids, "cpu", share_prompt=share)
        keys = packing.token_keys(b, "cpu", share_prompt=share)
        assert keys.shape == packed["input_ids"].shape  # one key per packed position
        return dict(zip(keys[0].tolist(), packed["input_ids"][0].tolist()))

    shared, copied = keyed(batch, True), keyed(batch, False)
    assert shared == copied  # every key names the same token either way
    assert len(shared) == 3 + 2 + sum(len(r) for r in responses)  # prompts once per group
    part = batch.select([4, 1])
    assert keyed(part, True).items() <= shared.items() and part.gids == [1, 0] and part.uids == [4, 1]
    assert packing.token_key(1, 3, prompt=True) != packing.token_key(1, 3) != packing.token_key(0, 3)


R3_WORKER = os.path.join(REPO, "tests", "workers", "routing_replay_r3.py")


@pytest.mark.parametrize("world,ulysses", [(1, 1), (2, 1), (2, 2)])
def test_r3_replays_vllm_format_rows_exactly(tiny_moe_8, tmp_path, world, ulysses):
    """R3's trainer side: rows in vLLM's format (an independent transformers routing, every third
    token moved) reach the experts bit-exactly, the log-probs equal transformers forced to them,
    and the agreement metric equals the reference's own count; with EP 2 and also as one Ulysses
    group of 2 (each rank routes its slice of every row, from the group's gathered rows)."""
    out = tmp_path / "r3.pt"
    run_torchrun(R3_WORKER, world, tiny_moe_8, str(out), f"ulysses={ulysses}")
    r = torch.load(out, weights_only=False)
    print(f"EP {world}: {r}")
    assert r["tokens"] > 0 and r["mismatched"] == 0
    assert r["unreplayed"] > 0  # the last sampled tokens route natively (vLLM ran no forward for them)
    assert r["diff_forced"] <= 1e-5
    assert r["first"]["actor/router_replay_missing"] == 0
    assert 0 < r["first"]["actor/router_agreement"] < 1
    assert abs(r["first"]["actor/router_agreement"] - r["agree_ref"]) < 1e-9
    assert r["step"]["actor/router_agreement"] == r["first"]["actor/router_agreement"]
    # a deliberate disagreement (the trainer's routers moved by noise, experts untouched)
    assert r["perturbed_agreement"] < 1
    assert r["mismatch_with"] < r["mismatch_without"]


@pytest.mark.unit
def test_rollout_routing_rows_by_hand():
    """vLLM's rows (P + R - 1 per sample: the last sampled token has none) become replay keys:
    a group's prompt rows once (from its first sample), every response row under its sample's
    key, the last tokens listed as free; a wrong row count is refused."""
    import numpy as np

    from rlcore.algo import batch as rollout_batch, packing

    prompts, responses = [[5, 6]] * 2 + [[7]], [[1, 2, 3], [4, 5], [8, 9]]
    rows = [np.arange(n * 2, dtype=np.uint8).reshape(n, 2, 1) + 10 * i
            for i, n in enumerate([4, 3, 2])]  # (P+R-1, layers 2, K 1)
    batch = rollout_batch.RolloutBatch(prompts, responses, [[0.0] * len(r) for r in responses], ["x"] * 3, ["stop"] * 3, 2,
                              routed_experts=rows)
    keys, experts, free = packing.rollout_routing(batch)
    k = packing.token_key
    assert keys.tolist() == [k(0, 0, True), k(0, 1, True), k(0, 2), k(0, 3),  # sample 0: prompt, 2 of 3 tokens
                             k(1, 2),  # sample 1: its group's prompt rows already given, 1 of 2 tokens
                             k(1, 0, True), k(2, 1)]  # sample 2: its own group
    assert experts.dtype == torch.uint8 and experts.shape == (7, 2, 1)
    assert experts[:, 0, 0].tolist() == [0, 2, 4, 6, 14, 20, 22]
    assert free.tolist() == [k(0, 4), k(1, 3), k(2, 2)]
    # select / concat carry the rows with their samples
    assert rollout_batch.concat([batch.select([2]), batch.select([0])]).routed_experts[1] is rows[0]
    batch.routed_experts[1] = rows[1][:1]
    with pytest.raises(RuntimeError, match="sample 1 has 1 rows .* for 4 tokens"):
        packing.rollout_routing(batch)


@pytest.mark.unit
def test_vllm_completion_routed_experts_reach_the_sample():
    """vLLM's own CompletionOutput (vllm 0.32 outputs.py:84) carries the rows into the Sample,
    and greedy copies keep them."""
    import numpy as np
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput

    from rlcore.colocate_rollout import _copy_sample, _to_sample

    rows = np.zeros((4, 2, 2), dtype=np.uint8)
    out = CompletionOutput(index=0, text="", token_ids=[3, 4], cumulative_logprob=None,
                           logprobs=[{3: Logprob(-0.5)}, {4: Logprob(-1.0)}], routed_experts=rows, finish_reason="stop")
    sample = _to_sample(out)
    assert sample.routed_experts is rows and sample.logprobs == [-0.5, -1.0]
    assert _copy_sample(sample).routed_experts is rows
