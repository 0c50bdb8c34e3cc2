"""The loss the trainer minimises and the update metrics it logs equal an independent
plain-PyTorch computation on the same batch (tests/workers/loss_reference.py): policy loss with
clip-higher and truncated importance weights, entropy bonus and k3 KL to a reference, through
the real FSDP2 engine on 2 ranks with response-only logits and shared-prompt packing."""

import os

import torch

from conftest import REPO, run_torchrun

WORKER = os.path.join(REPO, "tests", "workers", "loss_reference.py")


def test_trainer_loss_and_metrics_match_plain_pytorch(tiny_model, tmp_path):
    out = tmp_path / "ref.pt"
    run_torchrun(WORKER, 2, tiny_model, str(out))
    r = torch.load(out, weights_only=False)
    engine, ref = r["engine_grads"], r["ref_grads"]
    assert engine.shape == ref.shape and ref.norm() > 0
    rel = ((engine - ref).norm() / ref.norm()).item()
    print(f"gradient relative difference vs plain PyTorch: {rel:.2e}")
    assert rel <= 1e-5, rel  # fp32; sdpa over a packed shared-prompt row vs eager per sequence
    for key, want in r["ref_metrics"].items():
        got = r["engine_metrics"][key]
        print(f"{key}: engine {got:.8f} reference {want:.8f}")
        assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (key, got, want)
    # every term is active, so a sign error in any of them would show
    m = r["ref_metrics"]
    assert m["actor/kl"] > 1e-3 and m["actor/entropy"] > 0.1 and 0 < m["actor/clip_frac"] < 1
    assert 0 < m["rollout/tis_clip_frac"] < 1
