"""Global loss normalisation and the train-phase shortcuts through the real FSDP2 engine: for one
optimizer step the gradient does not depend on the micro-batch size (1, 2, 4), the number of ranks
(1, 2), response-only logits, shared-prompt packing (with a partial group, unequal lengths and a
lone-EOS response) or token-budget micro-batches, for every aggregation mode and both policy-loss
families (vanilla PPO/DAPO and GSPO)."""

import os

import torch

from conftest import REPO, run_torchrun
from rlcore.algo import advantage
from workers.grad_invariance import VARIANTS

WORKER = os.path.join(REPO, "tests", "workers", "grad_invariance.py")


def test_gradients_invariant_to_micro_batch_and_world_size(tiny_model, tmp_path):
    one, two = tmp_path / "w1.pt", tmp_path / "w2.pt"
    run_torchrun(WORKER, 1, tiny_model, str(one))
    run_torchrun(WORKER, 2, tiny_model, str(two))
    g1, g2 = torch.load(one, weights_only=True), torch.load(two, weights_only=True)
    reference = g1["token-mean/vanilla/full"]
    worst = 0.0
    for mode in advantage.AGG_MODES:
        for loss in ("vanilla", "gspo"):
            base = g1[f"{mode}/{loss}/full"]  # one rank, every position through the LM head
            assert base.norm() > 0
            for ranks, grads in ((1, g1), (2, g2)):
                for name in VARIANTS:
                    rel = ((grads[f"{mode}/{loss}/{name}"] - base).norm() / base.norm()).item()
                    worst = max(worst, rel)
                    assert rel <= 1e-5, f"{mode}/{loss} {name} on {ranks} ranks: relative gradient difference {rel:.2e}"
            if mode != "token-mean":  # the modes really differ, so the comparison is not vacuous
                assert ((base - reference).norm() / reference.norm()) > 1e-3, mode
    print(f"largest relative gradient difference: {worst:.2e}")
