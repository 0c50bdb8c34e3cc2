"""LoRA GRPO (rlcore/engine/lora.py, rlcore/rollout/lora.py, rlcore/config/lora.py): adapter-only
training and adapter-only weight sync through VeOmni's and vLLM's own LoRA.

The worker (tests/workers/lora_worker.py) checks the adapter's gradients against a hand-written
LoRA on transformers, vLLM's log-probs after each adapter push, a stale adapter, and vLLM's base
parameters; the end-to-end run goes through train_grpo.py on 2 ranks (one Ulysses group: each rank
runs half of every packed row) with the KL reference being the policy with its adapter off, and
checks the merged export."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import REPO, run_torchrun
from test_e2e import read_metrics, train

WORKER = os.path.join(REPO, "tests", "workers", "lora_worker.py")


def test_adapter_gradients_sync_and_untouched_base(tiny_model, tmp_path):
    out = tmp_path / "lora.pt"
    run_torchrun(WORKER, 1, tiny_model, str(out))
    r = torch.load(out, weights_only=False)
    print(r)
    # only the adapters train: 7 target layers x 2 layers x (A, B)
    assert r["optimizer_tensors"] == 28 and 0 < r["trainable"] < 100_000
    assert r["grad_diff"] <= 1e-5 * max(1.0, r["grad_scale"])  # = the hand-written LoRA's gradients
    assert all(d <= 1e-4 for d in r["diffs"]), r["diffs"]  # vLLM samples from the pushed adapter
    assert r["stale"] > 1e-3  # a stale adapter shows
    assert r["base_checked"] > 10 and r["base_changed"] == []  # vLLM's base weights bit-identical after 10 pushes
    assert len(r["diffs"]) == 10
    assert r["merged_diff"] <= 1e-5 and r["merged_vllm_diff"] <= 1e-4  # the merged export scores like the adapter
    assert r["restart_diff"] == 0  # lora.path loads the exported adapter exactly
    assert r["adapter_dir_left"] is False  # shutdown removes the engine's adapter folder in /dev/shm
    assert {"adapter_config.json", "adapter_model.safetensors", "merged", "tokenizer.json"} <= set(r["adapter_files"])


LORA_ARGS = ("--lora.rank", "8", "--lora.alpha", "16", "--optim.lr", "1e-2", "--algorithm.kl_loss_coef", "0.01",
             "--checkpoint.merge_lora", "true", "--checkpoint.save_every", "2",
             "--rollout.emulate_sleep", "true",  # LoRA's level 1 as on a GPU (rlcore/rollout/cpu_sleep.py)
             "--parallel.ulysses_size", "2")  # the adapters train as one Ulysses group of the 2 ranks
STEPS = 4


def test_lora_run_end_to_end(tiny_model, toy_data, tmp_path):
    out = str(tmp_path / "run")
    proc = train(2, tiny_model, toy_data[0], out, STEPS, *LORA_ARGS)
    assert "Ulysses sequence parallel 2" in proc.stdout
    rows = read_metrics(out)
    # exact resume after kill -9: the same run killed once step 3 is logged (checkpoint of step 2),
    # then resumed
    resumed = str(tmp_path / "resumed")
    from test_e2e import train_args
    from workers.launch import Launch, comparable

    killed = Launch(2, train_args(tiny_model, toy_data[0], resumed, STEPS, *LORA_ARGS))
    try:
        killed.wait_for(r"saved checkpoint .*step_2$", timeout=600)
        killed.wait_for(r"^step +3/", timeout=300)
        killed.kill9()
    finally:
        killed.close()
    train(2, tiny_model, toy_data[0], resumed, STEPS, *LORA_ARGS, "--checkpoint.resume", "auto")
    again = read_metrics(resumed)
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    assert [comparable(r) for r in again] == [comparable(r) for r in rows]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["rollout/mismatch_max"] < 1e-4  # every step samples from the trainer's adapter
    assert rows[0]["actor/kl"] == 0 and rows[-1]["actor/kl"] > 0  # reference = the adapter off
    # the export: a plain merged checkpoint = base + scale * B @ A of the exported adapter
    from safetensors.torch import load_file

    hf, adapter = os.path.join(out, "hf_final", "merged"), os.path.join(out, "hf_final")
    merged, base = load_file(os.path.join(hf, "model.safetensors")), load_file(os.path.join(tiny_model,
                                                                                             "model.safetensors"))
    lora = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    cfg = json.load(open(os.path.join(adapter, "adapter_config.json")))
    assert set(merged) == set(base)
    name = "model.layers.0.self_attn.q_proj.weight"
    a, b = (lora[f"base_model.model.{name[:-7]}.lora_{x}.weight"] for x in "AB")
    want = base[name] + cfg["lora_alpha"] / cfg["r"] * b @ a
    assert torch.allclose(merged[name], want, atol=1e-6) and not torch.equal(merged[name], base[name])
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert os.path.isfile(os.path.join(adapter, "tokenizer.json")) and not os.path.exists(os.path.join(adapter,
                                                                                                      "config.json"))
    # the checkpoint holds the adapters only (the base reloads from model.path)
    state = dcp_keys(os.path.join(out, "checkpoints", f"step_{STEPS}"))
    assert state and all(".lora_" in k for k in state if k.startswith("model.")), sorted(state)[:5]


def dcp_keys(ckpt: str) -> list[str]:
    """The tensor names a DCP checkpoint holds (its metadata file)."""
    from torch.distributed.checkpoint import FileSystemReader

    return list(FileSystemReader(ckpt).read_metadata().state_dict_metadata)


@pytest.mark.unit
def test_merged_weights_by_hand():
    from rlcore.engine.lora import merged

    w, a, b = torch.randn(4, 3), torch.randn(2, 3), torch.randn(4, 2)
    stream = [("base_model.model.model.norm.weight", torch.ones(3)),
              ("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight", w),
              ("base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight", a),
              ("base_model.model.model.layers.0.mlp.up_proj.lora_B.default.weight", b)]
    out = dict(merged(iter(stream), 0.5))
    assert list(out) == ["model.norm.weight", "model.layers.0.mlp.up_proj.weight"]
    assert torch.allclose(out["model.layers.0.mlp.up_proj.weight"], w + 0.5 * b @ a)
    with pytest.raises(RuntimeError, match="without their base weight"):
        list(merged(iter(stream[:2]), 0.5))


@pytest.mark.unit
def test_vllm_lora_engine_keywords():
    from rlcore.rollout.lora import engine_kwargs

    assert engine_kwargs(0) == {}
    assert engine_kwargs(8) == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    assert engine_kwargs(12)["max_lora_rank"] == 16  # vLLM's next size (config/lora.py:26)
    with pytest.raises(ValueError, match="above vLLM's largest LoRA rank 512"):
        engine_kwargs(1024)


@pytest.mark.unit
def test_adapter_folders_of_gone_processes_are_removed(tmp_path):
    """A run killed with kill -9 leaves its /dev/shm adapter folder (the adapter's bytes in memory):
    the next engine's adapter_dir removes the folders whose process is gone and keeps live ones."""
    import subprocess

    from rlcore.rollout import lora as rollout_lora

    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process now
    alive = subprocess.Popen(["sleep", "30"])
    try:
        for pid in (gone.pid, alive.pid):
            (tmp_path / f"rlcore-lora-{pid}").mkdir()
            (tmp_path / f"rlcore-lora-{pid}" / "adapter_model.safetensors").write_bytes(b"x" * 16)
        (tmp_path / "rlcore-lora-notapid").mkdir()
        mine = rollout_lora.adapter_dir(str(tmp_path))
        assert mine == str(tmp_path / f"rlcore-lora-{os.getpid()}")
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == sorted([f"rlcore-lora-{alive.pid}", "rlcore-lora-notapid"]), left
    finally:
        alive.kill()
        alive.wait()
