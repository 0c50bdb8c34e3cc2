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
    from rlcore.toy_task import make_tiny_moe_model

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
    assert r["diff_forced"] <= 1e-5  # transformers forced to the recorded experts
    per_layer = [r["routing"][f"debug/router_agreement_layer{i}"] for i in range(r["layers"])]
    assert all(0 <= a <= 1 for a in per_layer)


@pytest.mark.unit
def test_token_keys_name_the_same_tokens_however_packed():
    """Shared-prompt packing and a prompt copy per sample give each position the same key: one
    key per (sample, response position), one per (group, prompt position); selected sub-batches
    keep their samples' keys."""
    from rlcore import grpo

    prompts = [[5, 6, 7]] * 3 + [[8, 9]] * 2
    responses = [[1, 2], [3], [4, 5, 6], [7, 8], [9]]
    batch = grpo.RolloutBatch(prompts, responses, [[0.0] * len(r) for r in responses], ["x"] * 5, ["stop"] * 5, 3)
    assert batch.gids == [0, 0, 0, 1, 1]

    def keyed(b, share):
        packed = grpo.pack(b.prompt_ids, b.response_ids, "cpu", share_prompt=share)
        keys = grpo.token_keys(b, "cpu", share_prompt=share)
        assert keys.shape == packed["input_ids"].shape  # one key per packed position
        return dict(zip(keys[0].tolist(), packed["input_ids"][0].tolist()))

    shared, copied = keyed(batch, True), keyed(batch, False)
    assert shared == copied  # every key names the same token either way
    assert len(shared) == 3 + 2 + sum(len(r) for r in responses)  # prompts once per group
    part = batch.select([4, 1])
    assert keyed(part, True).items() <= shared.items() and part.gids == [1, 0] and part.uids == [4, 1]
    assert grpo.token_key(1, 3, prompt=True) != grpo.token_key(1, 3) != grpo.token_key(0, 3)
