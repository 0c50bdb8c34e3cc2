"""Worker (torchrun, 4 ranks): HSDP (``parallel.fsdp_size`` 2: two replicas of two shards each,
``rlcore.engine.build.mesh_sizes``) against plain FSDP over the 4 ranks, in one launch. Each phase
builds the real VeOmni FSDP2 policy, trains one GRPO update on the same fixed global batch (rank r
its contiguous quarter of it, ``tests/workers/grad_invariance.global_batch``), and records the
unsharded gradients, the grad norm and the weights after one optimizer step (clipped: grad_clip is
below the norm, so a norm summed over the wrong groups would change the weights), exported both
ways the weight sync does (``named_hf_weights`` and the bucketed gather over each parameter's shard
group). The HSDP phase also saves a DCP checkpoint after the step, takes a second step, then builds
a fresh HSDP policy, loads the checkpoint (weights must come back) and takes the same second step
(the optimizer state must have come back too). Between phases VeOmni's process-wide parallel state is
dropped with its own ``clear_parallel_state`` (veomni/distributed/parallel_state.py:434-445).

With MOE_DIR, two more phases: that mixture-of-experts model under expert parallel 2, plain FSDP
and fsdp_size 2 (no checkpoint). Then two with Ulysses sequence parallel 2, plain FSDP and
fsdp_size 2 (each shard group one Ulysses group).

    torchrun --nproc_per_node=4 tests/workers/hsdp.py MODEL_DIR OUT_DIR [MOE_DIR]
"""

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import os
import sys

import torch

from rlcore import advantage
from rlcore.algo import grpo
from rlcore.config import AlgorithmConfig
from rlcore.dist import init_distributed
from grad_invariance import GROUP, N, global_batch, grad_vector  # this directory is on sys.path under torchrun

GRAD_CLIP = 0.05  # below the step's grad norm (the test checks it), so the clip acts


def update(policy, info):
    """One GRPO update's gradients on this rank's quarter of the global batch (collective)."""
    batch, rewards = global_batch()
    adv = advantage.compute_advantages("grpo", rewards, batch.response_mask(), GROUP)
    per = N // info.world_size
    mine = list(range(info.rank * per, (info.rank + 1) * per))
    old = -0.1 * batch.response_mask()  # off-policy log-probs: ratios != 1, clipping active
    # under Ulysses the group's ranks run the group's samples together (as grpo.train_on_batch does)
    local, (l_adv, l_old), _ = grpo.sp_group_batch(policy, batch.select(mine), adv[mine], old[mine])
    inp = grpo.UpdateInputs(l_adv, l_old, None, torch.zeros_like(l_old), local.response_mask(), 1.0,
                            info.world_size)
    cfg = AlgorithmConfig(loss_agg_mode="token-mean", clip_high=0.28, micro_batch_size=2)
    grpo.accumulate_gradients(policy, local, list(range(len(local))), inp, cfg, {})


def weights(policy) -> dict:
    """The weight sync's full tensors, one at a time and bucketed (collective)."""
    one = {k: v.clone().cpu() for k, v in policy.named_hf_weights()}
    bucketed = {k: v.clone().cpu() for k, v in policy.named_hf_weights_bucketed(bucket_mb=0.05)}
    return {"one": one, "bucketed": bucketed}


def phase(model_dir, info, fsdp_size, ckpt=None, ep=1, ulysses=1) -> dict:
    from veomni.distributed import parallel_state as ps

    from rlcore.engine_veomni import VeOmniPolicy

    ps.clear_parallel_state()  # the other phase's mesh; VeOmni's state is one per process
    kw = dict(lr=1e-3, total_steps=4, grad_clip=GRAD_CLIP, fsdp_size=fsdp_size, ep_size=ep,
              ulysses_size=ulysses)
    policy = VeOmniPolicy(model_dir, info, **kw)
    state = ps.get_parallel_state()
    out = {"mesh": list(state.fsdp_mesh.mesh.shape), "replicate": state.dp_replicate_size}
    # each rank's local shard of the first decoder weight: 1/fsdp_size of its rows
    first = next(p for n, p in policy.model.named_parameters() if n.endswith("q_proj.weight"))
    out["local_rows"], out["full_rows"] = first.to_local().shape[0], first.shape[0]
    update(policy, info)
    out["grads"] = grad_vector(policy)
    out["grad_norm"] = policy.step()["actor/grad_norm"]
    out["step1"] = weights(policy)
    if ckpt is not None:
        policy.save_checkpoint(ckpt, {"marker": 7})
        update(policy, info)
        policy.step()
        out["step2"] = weights(policy)["one"]
        del policy
        gc.collect()
        fresh = VeOmniPolicy(model_dir, info, **kw)  # the same mesh: the state is reused
        out["extra"] = fresh.load_checkpoint(ckpt)
        out["loaded"] = weights(fresh)["one"]
        update(fresh, info)
        fresh.step()
        out["step2_resumed"] = weights(fresh)["one"]
    return out


def main():
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    info = init_distributed("cpu")
    results = {"fsdp": phase(model_dir, info, None),
               "hsdp": phase(model_dir, info, 2, ckpt=os.path.join(out_dir, "ckpt"))}
    if len(sys.argv) > 3:  # a mixture-of-experts model: expert parallel 2 inside each shard group of 2
        results["moe_fsdp"] = phase(sys.argv[3], info, None, ep=2)
        results["moe_hsdp"] = phase(sys.argv[3], info, 2, ep=2)
    # Ulysses groups of 2 inside each shard group of 2 (dp_shard 1 x ulysses 2, replicated twice)
    results["sp_fsdp"] = phase(model_dir, info, None, ulysses=2)
    results["sp_hsdp"] = phase(model_dir, info, 2, ulysses=2)
    if info.rank == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
