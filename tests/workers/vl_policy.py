"""torchrun worker for tests/test_vl_policy.py: a tiny Qwen3-VL, then a tiny Qwen2.5-VL, through
VeOmniPolicy (FSDP2 on gloo), on the packed rows the test built (inputs.pt).

Usage: torchrun --nproc_per_node=N vl_policy.py MODEL_DIR INPUTS_PT OUT_DIR
                                                [QWEN25_DIR QWEN25_INPUTS_PT QWEN25_LEGACY_DIR]

Every rank runs the same rows (except where a text-only row meets an image row across ranks);
rank 0 writes OUT_DIR/results.json (scalars, flags), OUT_DIR/tensors.pt (log-probs, exported
weights) and OUT_DIR/hf (save_hf).
"""

from __future__ import annotations

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import rlcore  # noqa: F401
from rlcore.dist import init_distributed
from rlcore.engine_veomni import VeOmniPolicy

LR = 1e-3


def logprobs(policy: VeOmniPolicy, row: dict, grad: bool = False) -> torch.Tensor:
    """(K,) log-probs of the row's selected response tokens."""
    logp, _ = policy.forward_logprobs(row["input_ids"], row["position_ids"], row["labels"], grad=grad,
                                      select=row["select"], attention_mask=row["attention_mask"], mm=row["mm"])
    return logp[0]


def weights(policy: VeOmniPolicy) -> dict:
    return {n: t.detach().cpu().clone() for n, t in policy.named_hf_weights()}


def grads(policy: VeOmniPolicy) -> dict:
    """Unsharded gradients by parameter name (collective)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for n, p in policy.model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        out[n] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().cpu().clone()
    return out


def weighted_loss(logp: torch.Tensor) -> torch.Tensor:
    """A nonzero policy-gradient-like loss: tokens pushed up and down by fixed weights."""
    w = torch.linspace(-1.0, 1.5, logp.shape[0])
    return -(logp * w).sum()


def n_optimizer_params(policy: VeOmniPolicy) -> int:
    return sum(len(g["params"]) for g in policy.optimizer.param_groups)


def input_errors(policy: VeOmniPolicy, row: dict, text_row: dict) -> list[str]:
    """Malformed image rows raise before any collective (so every rank raises alike)."""
    bad = {"(3, 1, L) positions": dict(position_ids=row["position_ids"][1:]),
           "(1, L) positions with images": dict(position_ids=row["position_ids"][0]),
           "an image missing": dict(mm={"pixel_values": row["mm"]["pixel_values"][:36],
                                        "image_grid_thw": row["mm"]["image_grid_thw"][:1]}),
           "image tokens without mm": dict(mm=None),
           "an unknown mm key": dict(mm={**row["mm"], "mm_token_type_ids": None})}
    caught = []
    for name, change in bad.items():
        try:
            logprobs(policy, {**row, **change})
        except ValueError:
            caught.append(name)
    try:  # images for a text-only row of a text-only layout: (4, 1, L) fine, a mm dict not
        logprobs(policy, {**text_row, "position_ids": text_row["position_ids"][None].expand(4, 1, -1)})
        caught.append("text row with (4, 1, L) positions runs")
    except ValueError:
        pass
    return caught


def shared_vs_unshared_grads(policy: VeOmniPolicy, data: dict) -> dict:
    """Relative difference of the gradients of sum(log-probs) of the shared-prompt and unshared
    rows, and the norms (all, vision tower)."""
    gs = {}
    for name in ("unshared", "shared"):
        policy.backward(logprobs(policy, data[name], grad=True).sum())
        gs[name] = grads(policy)
        policy.optimizer.zero_grad(set_to_none=True)
    num = sum((gs["shared"][n] - g).norm() ** 2 for n, g in gs["unshared"].items()) ** 0.5
    den = sum(g.norm() ** 2 for g in gs["unshared"].values()) ** 0.5
    return {"grad_rel_diff_shared_vs_unshared": float(num / den), "grad_norm_unshared": float(den),
            "visual_grad_norm": float(sum(g.norm() ** 2 for n, g in gs["unshared"].items()
                                          if n.startswith("model.visual.")) ** 0.5)}


def text_only_logprobs(policy: VeOmniPolicy, data: dict, W: int, rank: int) -> torch.Tensor:
    """A text-only row through the VL model; on 2 ranks the last rank's row meets rank 0's image
    row in the same FSDP forward/backward (VeOmni's dummy ViT forward keeps the collectives equal).
    Returns the last rank's log-probs of the text row."""
    mixed = data["text_only"] if (W > 1 and rank == W - 1) else data["packed"]
    logp = logprobs(policy, mixed, grad=True)
    policy.backward(logp.sum())
    policy.optimizer.zero_grad(set_to_none=True)
    text_only = logp.detach() if W > 1 else logprobs(policy, data["text_only"])
    gathered = [None] * W
    dist.all_gather_object(gathered, text_only)
    return gathered[-1]


def qwen25_checks(model_dir: str, inputs: str, legacy_dir: str, info, results: dict, tensors: dict) -> None:
    """Qwen2.5-VL: export, log-probs of the packed / shared / unshared / text-only rows, shared vs
    unshared gradients, the input refusals; then the released-layout folder, loaded with
    ``engine_vl.apply_checkpoint_key_mapping`` (set where rlcore.engine.build builds the model: the
    wrapper below stands in for that call), exported and run on the packed row."""
    from rlcore.engine import vl as engine_vl

    W, rank = info.world_size, info.rank
    data = torch.load(inputs, weights_only=False)
    times, clock = {}, time.perf_counter()
    policy = VeOmniPolicy(model_dir, info, lr=LR, grad_clip=None)
    results["q25_describe"] = policy.describe()
    tensors["q25_exported"] = weights(policy)
    for name in ("packed", "shared", "unshared"):
        tensors[f"q25_{name}"] = logprobs(policy, data[name])
    results["q25_input_errors"] = input_errors(policy, data["packed"], data["text_only"])
    results.update({f"q25_{k}": v for k, v in shared_vs_unshared_grads(policy, data).items()})
    tensors["q25_text_only"] = text_only_logprobs(policy, data, W, rank)
    del policy
    times["policy"] = round(time.perf_counter() - clock, 2)

    legacy = VeOmniPolicy(legacy_dir, info, trainable=False)  # released names: the engine maps them
    results["q25_legacy_mapping_set"] = bool(engine_vl.checkpoint_key_mapping(legacy.model)) and \
        getattr(legacy.model, "_checkpoint_conversion_mapping", None) is not None
    tensors["q25_legacy_exported"] = weights(legacy)
    tensors["q25_legacy_packed"] = logprobs(legacy, data["packed"])
    del legacy
    times["legacy"] = round(time.perf_counter() - clock - times["policy"], 2)
    results["q25_times_s"] = times


def main() -> None:
    model_dir, inputs, out = sys.argv[1], sys.argv[2], sys.argv[3]
    info = init_distributed("cpu")
    W, rank = info.world_size, info.rank
    data = torch.load(inputs, weights_only=False)
    results, tensors, times = {"world_size": W}, {}, {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        times[name] = round(now - clock, 2)
        clock = now

    # --- fp32 sdpa, trainable: export before any step, log-probs, gradients ---------------------
    policy = VeOmniPolicy(model_dir, info, lr=LR, grad_clip=None)
    results["describe_trained"] = policy.describe()
    tensors["exported"] = weights(policy)
    bucketed = {n: t.cpu().clone() for n, t in policy.named_hf_weights_bucketed(bucket_mb=0.05)}
    results["bucketed_equals_export"] = (set(bucketed) == set(tensors["exported"]) and
                                         all(torch.equal(bucketed[n], t) for n, t in tensors["exported"].items()))
    policy.save_hf(os.path.join(out, "hf"))
    lap("build + export")
    for name in ("packed", "shared", "unshared", "changed"):
        tensors[name] = logprobs(policy, data[name])
    lap("forwards")

    results["input_errors"] = input_errors(policy, data["packed"], data["text_only"])

    # shared-prompt vs unshared gradient of sum(log-probs)
    results.update(shared_vs_unshared_grads(policy, data))
    lap("shared/unshared grads")

    # a text-only row through the VL model (next to rank 0's image row on 2 ranks)
    tensors["text_only"] = text_only_logprobs(policy, data, W, rank)
    lap("text-only row")

    # one step without freezing: every tensor, the vision tower's included, moves
    policy.backward(weighted_loss(logprobs(policy, data["packed"], grad=True)))
    policy.step()
    tensors["after_trained"] = weights(policy)
    results["trained_optimizer_params"] = n_optimizer_params(policy)
    del policy
    lap("trained step")

    # --- freeze_vision_tower: same step, checkpoint, resume ---------------------------------------
    frozen = VeOmniPolicy(model_dir, info, lr=LR, grad_clip=None, freeze_vision_tower=True)
    results["describe_frozen"] = frozen.describe()
    results["frozen_optimizer_params"] = n_optimizer_params(frozen)
    frozen.backward(weighted_loss(logprobs(frozen, data["packed"], grad=True)))
    frozen.step()
    results["frozen_optimizer_state"] = len(frozen.optimizer.state)  # parameters with AdamW state
    tensors["after_frozen"] = weights(frozen)
    frozen.save_checkpoint(os.path.join(out, "ckpt"), extra_state={"step": 1})
    frozen.backward(weighted_loss(logprobs(frozen, data["shared"], grad=True)))
    frozen.step()
    second = weights(frozen)
    del frozen
    # gradient checkpointing on here (ViT blocks and decoder layers): recomputing changes no bit
    resumed = VeOmniPolicy(model_dir, info, lr=LR, grad_clip=None, freeze_vision_tower=True,
                           gradient_checkpointing=True)
    resumed.load_checkpoint(os.path.join(out, "ckpt"))
    results["resume_weights_equal"] = all(torch.equal(t, tensors["after_frozen"][n])
                                          for n, t in weights(resumed).items())
    resumed.backward(weighted_loss(logprobs(resumed, data["shared"], grad=True)))
    resumed.step()
    results["resume_next_step_equal"] = all(torch.equal(t, second[n]) for n, t in weights(resumed).items())
    del resumed
    lap("frozen step + checkpoint/resume")

    # --- eager attention (the block mask as an additive mask), frozen reference ------------------
    eager = VeOmniPolicy(model_dir, info, trainable=False, attn_implementation="eager")
    tensors["packed_eager"] = logprobs(eager, data["packed"])
    tensors["shared_eager"] = logprobs(eager, data["shared"])
    del eager
    lap("eager reference")

    # --- bf16 compute: forward, backward, step ----------------------------------------------------
    bf16 = VeOmniPolicy(model_dir, info, dtype="bfloat16", lr=LR)
    tensors["packed_bf16"] = logprobs(bf16, data["packed"])
    bf16.backward(weighted_loss(logprobs(bf16, data["shared"], grad=True)))
    metrics = bf16.step()
    results["bf16_step_finite"] = bool(torch.isfinite(torch.tensor(metrics["actor/grad_norm"]))) and \
        not metrics["actor/skipped"]
    del bf16
    lap("bf16 step")

    if len(sys.argv) > 4:  # --- Qwen2.5-VL ---------------------------------------------------------
        qwen25_checks(sys.argv[4], sys.argv[5], sys.argv[6], info, results, tensors)
        lap("qwen2.5-vl")

    results["times_s"] = times
    if rank == 0:
        print(json.dumps(results, indent=1))
        torch.save(tensors, os.path.join(out, "tensors.pt"))
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
