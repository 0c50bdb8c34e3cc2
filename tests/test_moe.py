"""Mixture-of-experts through the real engine on CPU: a tiny Qwen3-MoE (4 experts, top-2) with
VeOmni expert parallelism over 2 gloo ranks (the pure-torch EP experts of rlcore/engine_moe.py)
gives the logits and gradients of one rank without EP, and exports the checkpoint's names."""

import os

import pytest
import torch

from conftest import REPO, run_torchrun

WORKER = os.path.join(REPO, "tests", "workers", "moe_parallel.py")


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory) -> str:
    from rlcore.toy_task import make_tiny_moe_model

    return make_tiny_moe_model(str(tmp_path_factory.mktemp("tiny_moe")))


def test_expert_parallel_matches_one_rank(tiny_moe, tmp_path):
    runs = {}
    for world, ep in ((1, 1), (2, 1), (2, 2)):
        out = tmp_path / f"w{world}ep{ep}.pt"
        run_torchrun(WORKER, world, tiny_moe, str(out), str(ep))
        runs[(world, ep)] = torch.load(out, weights_only=False)
    ref = runs[(1, 1)]
    from safetensors.torch import load_file

    ckpt = load_file(os.path.join(tiny_moe, "model.safetensors"))
    for key, r in runs.items():
        logit_diff = (r["logits"] - ref["logits"]).abs().max().item()
        num = sum((r["grads"][n] - g).norm() ** 2 for n, g in ref["grads"].items()) ** 0.5
        den = sum(g.norm() ** 2 for g in ref["grads"].values()) ** 0.5
        print(f"world {key[0]} ep {key[1]}: logits max diff {logit_diff:.2e}, grad rel diff {num / den:.2e}, "
              f"router {({k: round(v, 4) for k, v in r['step'].items() if 'moe' in k})}")
        assert logit_diff <= 1e-5 and num / den <= 1e-5, key
        assert r["num_params"] == ref["num_params"] == sum(t.numel() for t in ckpt.values())
        assert set(r["weights"]) == set(ckpt)  # per-expert names, as transformers saved them
        s = r["step"]
        assert s["actor/moe_aux_loss"] > 0.5 and 1.0 <= s["actor/moe_load_mean"] <= s["actor/moe_load_max"] <= 4.0
        assert abs(s["actor/moe_aux_loss"] - ref["step"]["actor/moe_aux_loss"]) < 1e-5  # global statistics
    # the step moved the experts of every EP rank, by the same amounts as without EP
    moved = {n: (runs[(2, 2)]["weights"][n] - ckpt[n]).abs().max().item() for n in ckpt if ".experts." in n}
    assert min(moved.values()) > 0
    for n in ckpt:
        assert torch.allclose(runs[(2, 2)]["weights"][n], ref["weights"][n], atol=1e-5), n

