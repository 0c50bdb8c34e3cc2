"""Global loss normalisation and the train-phase shortcuts through the real FSDP2 engine: for one
optimizer step the gradient does not depend on the micro-batch size (1, 2, 4), the number of ranks
(1, 2), response-only logits, shared-prompt packing (with a partial group, unequal lengths and a
lone-EOS response) or token-budget micro-batches, for every aggregation mode and both policy-loss
families (vanilla PPO/DAPO and GSPO); nor on Ulysses sequence parallelism (2 ranks in one group,
each running half of every packed row, rlcore.engine.ulysses)."""

import os

import pytest
import torch

from conftest import REPO, run_torchrun
from rlcore.algo import advantage
from workers.grad_invariance import VARIANTS

WORKER = os.path.join(REPO, "tests", "workers", "grad_invariance.py")


@pytest.fixture(scope="module")
def by_ranks(tiny_model, tmp_path_factory):
    """Rank count -> the worker's gradients (1 and 2 ranks without sequence parallelism)."""
    out = {}
    for ranks in (1, 2):
        path = tmp_path_factory.mktemp("grads") / f"w{ranks}.pt"
        run_torchrun(WORKER, ranks, tiny_model, str(path))
        out[ranks] = torch.load(path, weights_only=True)
    return out


def test_gradients_invariant_to_micro_batch_and_world_size(by_ranks):
    g1, g2 = by_ranks[1], by_ranks[2]
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


def test_ulysses_sequence_parallel_gradients_equal_the_data_parallel_ones(by_ranks, tiny_model, tmp_path):
    """The same per-rank shares, once data parallel and once as one Ulysses group of 2 (the group's
    shares gathered, every packed row split in halves, attention over the whole row for 2 of the
    4 heads each): every mode, loss and packing variant gives the same gradient (fp32)."""
    path = tmp_path / "sp2.pt"
    run_torchrun(WORKER, 2, tiny_model, str(path), "2")
    sp, dp = torch.load(path, weights_only=True), by_ranks[2]
    assert sp.pop("sp/row_tokens") > 0 and sp.pop("sp/pad_tokens") > 0  # sliced rows, some padded
    worst_rel = worst_abs = 0.0
    for key, base in dp.items():
        rel = ((sp[key] - base).norm() / base.norm()).item()
        worst_rel, worst_abs = max(worst_rel, rel), max(worst_abs, (sp[key] - base).abs().max().item())
        assert rel <= 1e-6, f"{key}: relative gradient difference {rel:.2e} under sequence parallelism"
    assert sp.keys() == dp.keys()
    print(f"Ulysses 2 vs data parallel 2: largest relative gradient difference {worst_rel:.2e}, "
          f"largest absolute {worst_abs:.2e}")
