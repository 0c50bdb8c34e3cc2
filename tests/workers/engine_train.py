"""torchrun worker for tests/test_engine_fsdp.py: trains VeOmniPolicy a few steps and records
everything the tests compare against a single-process transformers + torch.optim reference.

Usage: torchrun --nproc_per_node=N engine_train.py MODEL_DIR OUT_DIR

Writes to OUT_DIR (rank 0): data.pt (every rank's packed micro-batches), logprobs.pt (per-rank
forward_logprobs outputs before training), params_final.pt (after 3 steps), params_resumed.pt
(checkpoint after step 1 -> fresh engine -> steps 2, 3), hf/ and hf_bf16_sharded/ (save_hf),
results.json (metrics and
in-worker checks).
"""

from __future__ import annotations

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import json
import os
import sys

import torch
import torch.distributed as dist

from rlcore.dist import all_reduce_sum, init_distributed
from rlcore.engine_veomni import VeOmniPolicy

STEPS, MICRO_BATCHES, SEQS_PER_MB = 3, 2, 3
RESUME_AFTER = 1  # checkpoint after step 1; two steps after resume also exercise the lr scheduler state
TEMPERATURE, ENTROPY_COEF = 0.7, 0.01
# adam_eps 1e-6, not 1e-8: with 1e-8 Adam's update g / (|g| + eps) turns the float32 rounding
# noise (~1e-10) of gradient elements that are themselves ~1e-8..1e-10 into update differences of
# a sizeable fraction of lr (measured: one element of 302k off by 5.6e-5 at ws=2). That is Adam
# amplifying a different summation order, not an engine error; 1e-6 keeps the 1e-5 bound meaningful.
ENGINE_KW = dict(
    lr=1e-3, weight_decay=0.01, betas=(0.9, 0.99), adam_eps=1e-6, lr_schedule="cosine",
    warmup_steps=1, total_steps=4, min_lr_ratio=0.1, grad_clip=0.5,
)


def make_micro_batch(seed: int, vocab: int = 26) -> dict:
    """Pack SEQS_PER_MB random sequences; the response part (after a short prompt) is scored."""
    g = torch.Generator().manual_seed(seed)
    ids, pos, labels, adv = [], [], [], []
    for _ in range(SEQS_PER_MB):
        n = int(torch.randint(5, 13, (), generator=g))
        prompt = int(torch.randint(2, 5, (), generator=g))
        seq = torch.randint(3, vocab, (n,), generator=g)
        lab = torch.full((n,), -100)
        lab[prompt - 1 : n - 1] = seq[prompt:]  # position t scores token t+1 of the response
        ids.append(seq)
        pos.append(torch.arange(n))
        labels.append(lab)
        adv.append(torch.full((n,), float(torch.randn((), generator=g))))
    cat = lambda xs: torch.cat(xs).unsqueeze(0)  # noqa: E731  (1, L)
    return {"input_ids": cat(ids), "position_ids": cat(pos), "labels": cat(labels), "adv": cat(adv)}


def all_data(world_size: int) -> list:
    """data[step][rank][mb], identical on every rank (seeded by position)."""
    return [[[make_micro_batch(1000 * s + 10 * r + m) for m in range(MICRO_BATCHES)]
             for r in range(world_size)] for s in range(STEPS)]


def train_step(policy: VeOmniPolicy, mbs: list, world_size: int) -> dict:
    """One optimizer step over this rank's micro-batches, loss normalised by the global token count."""
    local_tokens = sum(int((mb["labels"] != -100).sum()) for mb in mbs)
    (global_tokens,) = all_reduce_sum([float(local_tokens)])
    for mb in mbs:
        logp, ent = policy.forward_logprobs(mb["input_ids"], mb["position_ids"], mb["labels"],
                                            temperature=TEMPERATURE, with_entropy=True)
        mask = (mb["labels"] != -100).float()
        tok_loss = -mb["adv"] * logp - ENTROPY_COEF * ent  # (1, L)
        # FSDP2 averages gradients over ranks; x world_size turns that into the global token mean.
        policy.backward((tok_loss * mask).sum() / global_tokens * world_size)
    return policy.step()


def full_params(policy: VeOmniPolicy, dtype=None) -> dict:
    return {name: t.detach().cpu().clone() for name, t in policy.named_hf_weights(dtype)}


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    info = init_distributed("cpu")
    W, rank = info.world_size, info.rank
    data = all_data(W)
    results: dict = {"world_size": W}

    actor = VeOmniPolicy(model_dir, info, **ENGINE_KW)
    ref = VeOmniPolicy(model_dir, info, trainable=False)
    results["num_params"] = actor.num_params

    # Packed forward before training (test 3) and the frozen reference on the same batch.
    mb0 = data[0][rank][0]
    logp, ent = actor.forward_logprobs(mb0["input_ids"], mb0["position_ids"], mb0["labels"],
                                       temperature=TEMPERATURE, with_entropy=True, grad=False)
    ref_logp, ref_ent = ref.forward_logprobs(mb0["input_ids"], mb0["position_ids"], mb0["labels"],
                                             temperature=TEMPERATURE, with_entropy=False)
    results["ref_entropy_is_none"] = ref_ent is None
    results["ref_vs_actor_logp_maxdiff"] = float((ref_logp - logp).abs().max())
    results["no_grad_output"] = not logp.requires_grad
    gathered = [None] * W
    dist.all_gather_object(gathered, {"logp": logp, "entropy": ent})

    metrics = []
    for s in range(STEPS):
        metrics.append(train_step(actor, data[s][rank], W))
        if s == RESUME_AFTER - 1:
            actor.save_checkpoint(os.path.join(out, "ckpt"), extra_state={"step": s + 1, "note": "x"})
    results["metrics"] = metrics
    final = full_params(actor)
    results["bf16_export_exact"] = all(
        torch.equal(t, final[n].to(torch.bfloat16)) for n, t in full_params(actor, torch.bfloat16).items()
    )
    actor.save_hf(os.path.join(out, "hf"))
    actor.save_hf(os.path.join(out, "hf_bf16_sharded"), dtype="bfloat16", max_shard_bytes=200_000)
    check_offload_and_nan_skip(actor, mb0, final, results)

    # Resume: fresh engine, load the step-1 checkpoint, redo steps 2 and 3. Gradient
    # checkpointing on here: recomputing layers must not change a single bit on CPU.
    resumed = VeOmniPolicy(model_dir, info, gradient_checkpointing=True, **ENGINE_KW)
    results["loaded_extra_state"] = resumed.load_checkpoint(os.path.join(out, "ckpt"))
    results["resumed_metrics"] = [train_step(resumed, data[s][rank], W) for s in range(RESUME_AFTER, STEPS)]
    resumed_params = full_params(resumed)

    if rank == 0:
        torch.save(data, os.path.join(out, "data.pt"))
        torch.save(gathered, os.path.join(out, "logprobs.pt"))
        torch.save(final, os.path.join(out, "params_final.pt"))
        torch.save(resumed_params, os.path.join(out, "params_resumed.pt"))
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def check_offload_and_nan_skip(actor: VeOmniPolicy, mb: dict, final: dict, results: dict) -> None:
    """offload/onload keep the numbers; a NaN gradient skips the step and leaves params alone."""
    args = (mb["input_ids"], mb["position_ids"], mb["labels"])
    before, _ = actor.forward_logprobs(*args, grad=False)
    actor.offload()
    actor.onload()
    after, _ = actor.forward_logprobs(*args, grad=False)
    results["offload_roundtrip_equal"] = bool(torch.equal(before, after))
    logp, _ = actor.forward_logprobs(*args)
    actor.backward(logp.sum() * float("nan"))
    results["nan_step"] = actor.step()
    results["nan_step_params_unchanged"] = all(torch.equal(t, final[n]) for n, t in full_params(actor).items())


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
