"""Worker (torchrun) for tests/test_switch.py: the phase machine and the bucketed weight sync on
real VeOmni FSDP2 shards and a real in-process vLLM engine.

    torchrun --nproc_per_node=2 tests/workers/switch_sync.py MODEL_DIR OUT_JSON          # full
    torchrun --nproc_per_node=3 tests/workers/switch_sync.py MODEL_DIR OUT_JSON export   # no vLLM

The model has odd dims (vocab 29, intermediate 255) so FSDP2's dim-0 shards are uneven.
Full mode: one GRPO step through PhaseSwitcher, then for each bucket size (smaller than one
tensor, one decoder layer, larger than the model) vLLM is reset to the initial checkpoint weights,
the trainer's weights are synced with that bucket size, and vLLM's log-probs of fresh samples are
compared with the trainer's. Also: bucketed export == per-tensor export bit for bit, the level-2
"weights valid" guard, switch order, metrics. Export mode: only the bit-for-bit comparison.
"""

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import json
import os
import sys

import torch

from rlcore import advantage
from rlcore.algo import grpo
from rlcore.config import AlgorithmConfig
from rlcore.dist import init_distributed
from rlcore.metrics import Timer
from rlcore.step.switch import PhaseSwitcher
from sync_logprobs import max_diff, sample  # same folder: torchrun puts it on sys.path

TEMPERATURE = 0.8
PROMPTS = [[13, 4 + i, 5, 6, 7, 14, 18, 15] for i in range(4)]


def bucket_sizes(policy) -> dict[str, float]:
    """MiB: below the smallest tensor, exactly one decoder layer, above the whole model."""
    sizes = {name: p.numel() * 4 for name, p in policy.model.named_parameters()}
    layer = sum(v for k, v in sizes.items() if ".layers.0." in k)
    return {"tiny": min(sizes.values()) / 2 / 2**20, "layer": layer / 2**20, "huge": 2 * sum(sizes.values()) / 2**20}


def export_checks(policy, sizes: dict, r: dict) -> None:
    """Bucketed export equals the per-tensor full_tensor() export exactly, fp32 and bf16."""
    for dtype in ("float32", "bfloat16"):
        ref = {n: t.clone() for n, t in policy.named_hf_weights(dtype)}
        for label, mb in sizes.items():
            got = dict(policy.named_hf_weights_bucketed(dtype, mb))
            r[f"exact_{label}_{dtype}"] = got.keys() == ref.keys() and all(
                got[n].dtype == ref[n].dtype and torch.equal(got[n], ref[n]) for n in ref)
            r[f"plan_{label}_{dtype}"] = policy.sync_plan_summary(dtype, mb)
    r["num_tensors"] = len(ref)


def initial_weights(model_dir: str) -> list:
    from safetensors.torch import load_file

    return list(load_file(os.path.join(model_dir, "model.safetensors")).items())


def grpo_step(switch, policy, rollout, device, world, r: dict) -> None:
    """One GRPO step between the two switches; records their traces and what was released."""
    batch = sample(rollout, PROMPTS, TEMPERATURE, seed=1)
    rewards = torch.tensor([float(len(x)) for x in batch.response_ids])  # made up: longer is better
    adv = advantage.compute_advantages("grpo", rewards, batch.response_mask(), 4)
    switch.to_training()
    r["trace_to_training"] = switch.trace
    r["released_while_training"] = sorted(rollout.released)
    grpo.ppo_update(policy, batch, adv, None, None, AlgorithmConfig(micro_batch_size=8), TEMPERATURE, world, device)
    switch.to_generation()
    r["trace_to_generation"] = switch.trace
    r["released_after_switch"] = sorted(rollout.released)


def sync_checks(policy, rollout, model_dir, sizes, device, r: dict) -> None:
    """Per bucket size: reset vLLM to the initial weights (stale), sync, compare log-probs."""
    init = initial_weights(model_dir)
    for i, (label, mb) in enumerate(sizes.items()):
        rollout.update_weights(iter(init))
        stale = sample(rollout, PROMPTS, TEMPERATURE, seed=10 + i)
        r[f"stale_{label}"] = max_diff(policy, rollout, stale, TEMPERATURE, device)
        n = rollout.update_weights(policy.named_hf_weights_bucketed("float32", mb))
        fresh = sample(rollout, PROMPTS, TEMPERATURE, seed=20 + i)
        r[f"synced_{label}"] = max_diff(policy, rollout, fresh, TEMPERATURE, device)
        r[f"tokens_{label}"] = int(fresh.response_mask().sum())
        r[f"pushed_{label}"] = n


def guard_checks(policy, rollout, r: dict) -> None:
    """What a level-2 sleep leaves behind (weights_valid False): generate refuses until a full
    update; a partial update does not count; a truncated "full" update raises."""
    def try_generate() -> str:
        try:
            rollout.generate(PROMPTS[:1], n=1, max_tokens=2, seed=0)
            return "ok"
        except RuntimeError as e:
            return f"RuntimeError: {e}"

    rollout.weights_valid = False  # exactly what release_memory() does at sleep level 2
    r["guard_after_sleep2"] = try_generate()
    weights = list(policy.named_hf_weights_bucketed("float32", 1.0))
    rollout.update_weights(iter(weights[:3]), full=False)
    r["guard_after_partial"] = try_generate()
    try:
        rollout.update_weights(iter(weights[:-1]), full=True)
        r["truncated_full"] = "accepted"
    except RuntimeError as e:
        r["truncated_full"] = f"RuntimeError: {e}"
    rollout.update_weights(iter(weights), full=True)
    r["guard_after_full"] = try_generate()


def main():
    model_dir, out = sys.argv[1], sys.argv[2]
    export_only = len(sys.argv) > 3 and sys.argv[3] == "export"
    info = init_distributed("cpu")
    from rlcore.engine_veomni import VeOmniPolicy

    torch.manual_seed(0)
    policy = VeOmniPolicy(model_dir, info, lr=1e-2, total_steps=10)
    sizes = bucket_sizes(policy)
    r = {"world": info.world_size, "sizes_mb": sizes}
    export_checks(policy, sizes, r)
    if not export_only:
        from rlcore.colocate_rollout import ColocateRollout

        rollout = ColocateRollout(model_dir, info, tp_size=1, seed=0, max_model_len=64, kv_cache_gb=0.1)
        timer = Timer()
        switch = PhaseSwitcher(policy, rollout, timer, "cpu", offload_params=True, offload_optimizer=False,
                               free_kv_cache=True, rollout_dtype="float32", sync_bucket_mb=sizes["layer"])
        switch.phase = "training"
        try:
            switch.to_training()
        except RuntimeError as e:
            r["wrong_order"] = f"RuntimeError: {e}"
        switch.phase = "generation"
        grpo_step(switch, policy, rollout, info.device, info.world_size, r)
        r["metrics"] = {**timer.pop_metrics(), **switch.pop_metrics()}
        r["describe"] = switch.describe()
        sync_checks(policy, rollout, model_dir, sizes, info.device, r)
        guard_checks(policy, rollout, r)
        rollout.shutdown()
    if info.rank == 0:
        with open(out, "w") as f:
            json.dump(r, f, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
