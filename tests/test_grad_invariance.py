"""Global loss normalisation and the train-phase shortcuts through the real FSDP2 engine: for one
optimizer step the gradient does not depend on the micro-batch size (1, 2, 4), the number of ranks
(1, 2), response-only logits, shared-prompt packing (with a partial group, unequal lengths and a
lone-EOS response) or token-budget micro-batches, for every aggregation mode and both policy-loss
families (vanilla PPO/DAPO and GSPO); nor on Ulysses sequence parallelism (2 ranks in one group,
each running half of every packed row, rlcore.engine.ulysses), also for a mixture-of-experts model
with expert parallelism and R2 routing replay, for a LoRA policy on multi-turn batches (tool
tokens masked out of the loss), and for a Qwen3-VL policy whose vision tower trains on sliced patches."""

import os

import pytest
import torch

from conftest import REPO, run_torchrun
from rlcore import advantage
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
    4 heads each): every mode, loss and packing variant gives the same gradient and the same policy
    loss (fp32)."""
    path = tmp_path / "sp2.pt"
    run_torchrun(WORKER, 2, tiny_model, str(path), "ulysses=2")
    sp, dp = torch.load(path, weights_only=True), by_ranks[2]
    assert sp.pop("sp/row_tokens") > 0 and sp.pop("sp/pad_tokens") > 0  # sliced rows, some padded
    worst_rel, worst_abs = _compare(sp, dp, "dense")
    print(f"Ulysses 2 vs data parallel 2: largest relative gradient difference {worst_rel:.2e}, "
          f"largest absolute {worst_abs:.2e}; largest policy-loss difference {_loss_diff(sp, dp):.2e}")


def test_ulysses_through_veomnis_flash_path_equals_data_parallel(by_ranks, tiny_model, tmp_path):
    """A flash kernel under Ulysses (issue 60, F1b): the policy takes VeOmni's own Ulysses flash path
    (its all-to-all, transformers' varlen call with the row's cu_seq_lens), with the CUDA kernel
    replaced by a stand-in that attends by sdpa per cu_seq_lens segment: the cu_seq_lens it receives
    are the sdpa path's segments on every call, and the gradients and losses equal data parallelism's
    (the few modes, every packing variant without a dense mask)."""
    path = tmp_path / "flash.pt"
    run_torchrun(WORKER, 2, tiny_model, str(path), "ulysses=2", "flash=1", "few=1")
    sp = torch.load(path, weights_only=True)
    calls, mismatch = sp.pop("flash/calls").item(), sp.pop("flash/cu_mismatch").item()
    assert calls > 0 and mismatch == 0, (calls, mismatch)  # every attention call went through the flash path
    assert sp.pop("sp/row_tokens") > 0 and sp.pop("sp/pad_tokens") > 0
    dp = {k: by_ranks[2][k] for k in sp}
    worst_rel, worst_abs = _compare(sp, dp, "flash")
    print(f"Ulysses 2 through VeOmni's flash path ({calls:.0f} kernel calls) vs data parallel 2: largest relative "
          f"gradient difference {worst_rel:.2e}, absolute {worst_abs:.2e}")


def _compare(sp: dict, dp: dict, what: str, tol: float = 1e-6) -> tuple[float, float]:
    """Every gradient within ``tol`` relative (the worst relative and absolute differences are
    returned) and every summed policy loss (``/loss``) within ``tol`` x max(|loss|, 1): a loss is a
    sum of terms of both signs, so its relative error is unbounded near zero."""
    worst_rel = worst_abs = 0.0
    for key, base in dp.items():
        if key.endswith("/loss"):
            diff = abs(sp[key].item() - base.item())
            assert diff <= tol * max(abs(base.item()), 1.0), f"{what} {key}: policy loss {base.item()} vs {sp[key]}"
            continue
        rel = ((sp[key] - base).norm() / base.norm()).item()
        worst_rel, worst_abs = max(worst_rel, rel), max(worst_abs, (sp[key] - base).abs().max().item())
        assert rel <= tol, f"{what} {key}: relative gradient difference {rel:.2e} under sequence parallelism"
    assert sp.keys() == dp.keys()
    return worst_rel, worst_abs


def _dp_and_sp(tmp_path, model: str, *opts: str) -> tuple[dict, dict]:
    """The worker's results for ``model`` with ``opts`` on 2 ranks, as one Ulysses group and data
    parallel; the Ulysses run really sliced (and padded) its rows."""
    runs = {}
    for name, extra in (("sp", ("ulysses=2",)), ("dp", ())):
        run_torchrun(WORKER, 2, model, str(tmp_path / f"{name}.pt"), *opts, *extra)
        runs[name] = torch.load(tmp_path / f"{name}.pt", weights_only=True)
    assert runs["sp"].pop("sp/row_tokens") > 0 and runs["sp"].pop("sp/pad_tokens") > 0
    return runs["sp"], runs["dp"]


def _loss_diff(sp: dict, dp: dict) -> float:
    return max(abs(sp[k].item() - v.item()) for k, v in dp.items() if k.endswith("/loss"))


def test_ulysses_with_experts_parallel_and_routing_replay_equals_data_parallel(tmp_path):
    """A tiny Qwen3-MoE (2 attention heads, 1 KV head: VeOmni's all-to-all repeats it for the
    group) with its 4 experts split over the 2 ranks (EP 2) and R2 replay: as one Ulysses group the
    gradients equal data parallel's for a token- and a sequence-level mode (``FEW_MODES``), both
    losses and every packing variant. The recording forward
    packs one sample per row, the updates pack 1-4 per row (and share prompts): each token is
    replayed, wherever its slice now falls (agreement 1, nothing missing)."""
    from rlcore.demo.toy import make_tiny_moe_model

    sp, dp = _dp_and_sp(tmp_path, make_tiny_moe_model(str(tmp_path / "moe")), "ep=2", "replay=1", "few=1")
    for r in (sp, dp):  # every replayed token found its recording, and the weights did not move
        assert r.pop("actor/router_replay_missing").item() == 0
        assert r.pop("actor/router_agreement").item() == 1.0
    worst_rel, worst_abs = _compare(sp, dp, "MoE EP 2 + R2")
    print(f"MoE, EP 2, R2 replay: Ulysses 2 vs data parallel 2: largest relative gradient difference "
          f"{worst_rel:.2e}, largest absolute {worst_abs:.2e}; policy loss {_loss_diff(sp, dp):.2e}")


def test_ulysses_with_lora_on_multi_turn_batches_equals_data_parallel(tiny_model, tmp_path):
    """A rank-4 LoRA policy (B moved off zero) on batches whose responses hold tool output
    (``env_mask`` 0: attended to, not trained): Ulysses 2 equals data parallel 2 for ``FEW_MODES``,
    both losses and every packing variant, and the adapters really get gradients."""
    sp, dp = _dp_and_sp(tmp_path, tiny_model, "lora=4", "env=1", "few=1")
    worst_rel, worst_abs = _compare(sp, dp, "LoRA + env mask", tol=2e-6)  # measured 9.4e-7: small adapter grads
    print(f"LoRA 4, multi-turn masks: Ulysses 2 vs data parallel 2: largest relative gradient difference "
          f"{worst_rel:.2e}, largest absolute {worst_abs:.2e}; policy loss {_loss_diff(sp, dp):.2e}")


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_ulysses_with_a_vision_language_policy_equals_data_parallel(tmp_path, family):
    """A tiny Qwen3-VL (vision tower trained, deepstack merger), and a tiny Qwen3-VL-MoE with its
    experts split over the 2 ranks (EP 2), on a batch whose second group has an image and whose first
    is text-only: as one Ulysses group each rank runs half of every row's positions and half of its
    image patches (the ViT's attention all-to-all'd within each image,
    ``rlcore.engine.ulysses.vision_attention``), and ``FEW_MODES`` x both losses x every packing
    variant give data parallel's gradient, the vision tower's part included."""
    if family == "qwen3_vl":
        from rlcore.demo.vl import make_tiny_vl_model

        vl, ep = make_tiny_vl_model(str(tmp_path / "vl")), "ep=1"
    else:
        from workers.vl_moe import make_tiny_vl_moe_model

        vl, ep = make_tiny_vl_moe_model(str(tmp_path / "vl")), "ep=2"
    sp, dp = _dp_and_sp(tmp_path, vl, "vl=1", ep, "few=1")
    assert sp.pop("sp/vit_calls") > 0
    assert dp["token-mean/vanilla/full/vision"].norm() > 0
    worst_rel, worst_abs = _compare(sp, dp, family)
    vision = max(((sp[k] - dp[k]).norm() / dp[k].norm()).item() for k in dp if k.endswith("/vision"))
    print(f"{family}: Ulysses 2 vs data parallel 2: largest relative gradient difference {worst_rel:.2e} "
          f"(vision tower {vision:.2e}), largest absolute {worst_abs:.2e}; policy loss {_loss_diff(sp, dp):.2e}")
