"""The benchmark scripts run end to end at a tiny size, exactly as a user starts them, and their
last line holds the documented JSON fields. Only correctness is asserted here (the synced
weights match the trainer's, the replayed generation is identical); their timings are figures
to read, not to test."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import QUIET_ENV, REPO


def run_bench(name: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, os.path.join("scripts", name), *args], cwd=REPO,
                          env={**os.environ, **QUIET_ENV}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bench_weight_sync_small():
    r = run_bench("bench_weight_sync.py", "--params", "2e6", "--reps", "1", "--bucket-mb", "1,64", "--nproc", "2",
                  "--lora", "8")
    for key in ("params", "sync_s", "naive_s", "floor_s", "speedup_vs_naive", "ratio_to_floor",
                "peak_extra_rss_mb", "max_logprob_diff", "floor_kernel_s", "speedup_ceiling_kernel"):
        assert key in r and r[key] == r[key], key  # present and not NaN
    assert 2e6 < r["params"] < 20e6 and r["ranks"] == 2
    assert set(r["sync_s_by_bucket_mb"]) == {"1", "64"}
    # the benchmarked sync really moves vLLM from the stale checkpoint to the trainer's weights
    assert r["stale_logprob_diff"] > 0.1
    assert r["max_logprob_diff"] <= 1e-4
    assert r["plan"]["buckets"] > 1  # a 1 MiB bucket splits this model
    # --lora: the adapter push on the same model moves a small fraction of the bytes, and vLLM
    # then samples from the trainer's adapter
    assert r["lora_tensors"] > 0 and 0 < r["lora_bytes"] < r["full_bytes"] / 5 and r["lora_push_s"] > 0
    assert r["lora_max_logprob_diff"] <= 1e-4


def test_bench_weight_sync_moe_small():
    """--moe: the same fields for a Qwen3-MoE with expert parallelism 2; vLLM ends on the trainer's experts."""
    r = run_bench("bench_weight_sync.py", "--params", "4e6", "--reps", "1", "--nproc", "2", "--moe")
    for key in ("params", "sync_s", "naive_s", "floor_s", "speedup_vs_naive", "max_logprob_diff"):
        assert key in r and r[key] == r[key], key
    assert r["stale_logprob_diff"] > 0.1 and r["max_logprob_diff"] <= 1e-4
    # the sync pushes each layer's experts as 2 fused tensors; the per-expert push (3 per expert)
    # it replaced is measured beside it and lands on the same weights
    saved = r["tensors_per_expert"] - r["tensors"]  # per layer: 3 x 8 expert tensors become 2
    assert saved > 0 and saved % (3 * 8 - 2) == 0, r
    assert r["max_logprob_diff_per_expert"] <= 1e-4 and r["sync_per_expert_s"] > 0


def test_bench_step_small():
    # --n and --nproc prefix torchrun's own options: they must reach the script, not torchrun.
    # One --variant (the comparison path, one run): the MoE model with EP 2 and R2 routing replay.
    out = run_bench("bench_step.py", "--steps", "1", "--warmup", "1", "--response-len", "4",
                    "--prompts-per-step", "4", "--n", "2", "--nproc", "2", "--moe",
                    "--variant", "r2=--algorithm.mini_batches 2 --algorithm.routing_replay r2")
    (row,) = out["variants"]
    assert row["variant"] == "r2" and row["train_ratio"] == 1.0
    r = row["result"]
    for key in ("overhead_ratio", "rollout_efficiency", "step_s", "generate_s", "train_s", "weight_sync_s"):
        assert key in r and r[key] > 0, key
    assert r["replay_same_tokens"] is True  # the bare vLLM call sampled exactly the trainer's tokens
    assert r["ranks"] == 2 and r["steps"] == 1
    phases = {"generate", "release_rollout", "onload", "train", "offload_optimizer", "wake_weights",
              "sync_weights", "offload_params", "wake_kv_cache"}
    assert {f"memory/{p}_rss_gb" for p in phases} <= set(r["phases"])


@pytest.mark.unit
def test_bench_step_variants_leave_the_base_arguments():
    sys.path.insert(0, REPO)
    from scripts.bench_step import without_variants

    argv = ["--moe", "--variant", "a=--x 1", "--steps", "2", "--variant=b=--y", "--n", "2"]
    assert without_variants(argv) == ["--moe", "--steps", "2", "--n", "2"]


def test_bench_train_small():
    # a 2-layer, 512-token-vocab SmolLM2-shaped model; --n prefixes torchrun's own options
    r = run_bench("bench_train.py", "--layers", "2", "--vocab", "512", "--prompts", "2", "--n", "4",
                  "--repeats", "1", "--nproc", "2")
    for key in ("baseline_s", "optimized_s", "speedup", "max_grad_rel_diff", "target_speedup", "meets_target",
                "prompts", "n", "prompt_len", "response_len", "micro_batch_tokens"):
        assert key in r, key
    assert r["ranks"] == 2 and r["layers"] == 2 and r["vocab"] == 512
    assert list(r["variants"]) == ["baseline", "+response_only", "+shared_prompt", "+token_budget"]
    for name, v in r["variants"].items():
        assert v["median_s"] > 0 and v["peak_rss_mib"] >= 0, name
    assert r["variants"]["baseline"]["grad_rel_diff"] == 0.0
    # every packing option leaves the gradient of the step unchanged
    assert r["max_grad_rel_diff"] <= 1e-5
    # the shared prompt is packed once per group: fewer tokens through the decoder
    assert r["variants"]["+shared_prompt"]["packed_tokens"] < r["variants"]["+response_only"]["packed_tokens"]


def test_bench_train_log_prob_micro_batches_small():
    # the old + reference forwards at training's micro-batch (2) vs 4x it (algorithm.log_prob_micro_batch_size)
    r = run_bench("bench_train.py", "--log-prob-factor", "4", "--layers", "2", "--vocab", "512", "--prompts", "2",
                  "--n", "4", "--repeats", "1", "--nproc", "2")
    assert r["log_prob"] and r["ranks"] == 2 and r["factor"] == 4 and r["ratio"] > 0
    assert {n: v["forwards"] for n, v in r["variants"].items()} == {"train_micro": 4, "x4": 2}  # 4 sequences/rank
    assert r["max_logp_diff"] <= 1e-5  # the same log-probs


def test_bench_vl_small():
    # image+text demo at a tiny size: 1 warm-up + 1 measured step, 4 prompts x 2 samples
    r = run_bench("bench_vl.py", "--steps", "1", "--warmup", "1", "--prompts_per_step", "4", "--n", "2",
                  "--nproc", "2")
    for key in ("generate_s", "train_s", "vision_fwd_s", "vision_bwd_s", "text_s", "sync_s", "step_s",
                "vision_share_of_train"):
        assert key in r and r[key] > 0, (key, r.get(key))
    assert r["vision_fwd_s"] + r["vision_bwd_s"] < r["train_s"] < r["step_s"]
    assert 0 < r["vision_share_of_train"] < 1
    # the trained tower's backward was timed, every started interval ended, the hooks left the numbers alone
    assert r["vision_backward"] is True and r["vision_backward_complete"] is True
    assert r["vision_calls_per_step"] >= 1 and r["mismatch_max"] < 1e-3
    assert len(r["peak_rss_gb"]) == 2 and all(0 < gb < 64 for gb in r["peak_rss_gb"])
    assert r["ranks"] == 2 and r["steps"] == 1 and r["freeze_vision_tower"] is False
