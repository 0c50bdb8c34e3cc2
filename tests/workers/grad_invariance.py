"""Worker (torchrun, 1 or 2 ranks): the gradient of one optimizer step's loss for every aggregation
mode and micro-batch sizes 1, 2 and 4, through the real FSDP2 engine. Rank r of W trains on its
contiguous share of one fixed global batch; rank 0 saves the unsharded gradients.

    torchrun --nproc_per_node=W tests/workers/grad_invariance.py MODEL_DIR OUT.pt
"""

import dataclasses
import sys

import torch

from rlcore import advantage, grpo
from rlcore.config import AlgorithmConfig
from rlcore.dist import init_distributed

N, GROUP = 8, 4


def global_batch() -> tuple[grpo.RolloutBatch, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 26, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(N)]
    lengths = [7, 1, 4, 9, 3, 5, 2, 8]
    responses = [torch.randint(3, 26, (n,), generator=g).tolist() for n in lengths]
    batch = grpo.RolloutBatch(prompts, responses, [[0.0] * n for n in lengths], ["x"] * N, ["stop"] * N, GROUP)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.0, 1.0, 0.3, 0.0])
    return batch, rewards


@torch.no_grad()
def grad_vector(policy) -> torch.Tensor:
    """All accumulated gradients of the engine, unsharded and flattened in parameter order (collective)."""
    from torch.distributed.tensor import DTensor

    parts = []
    for p in policy.model.parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        parts.append((g.full_tensor() if isinstance(g, DTensor) else g).flatten().float().cpu())
    return torch.cat(parts)


def main():
    model_dir, out = sys.argv[1], sys.argv[2]
    info = init_distributed("cpu")
    from rlcore.engine_veomni import VeOmniPolicy

    policy = VeOmniPolicy(model_dir, info, lr=1e-3, total_steps=1)
    batch, rewards = global_batch()
    adv = advantage.compute_advantages("grpo", rewards, batch.response_mask(), GROUP)  # (N, T) global
    # Old/ref log-probs off the current ones, so clipping, dual clip and KL are all active.
    cur = grpo.compute_logprobs_in_chunks(policy, batch, 0.9, N, info.device)
    noise = torch.randn(cur.shape, generator=torch.Generator().manual_seed(1))
    old, ref = cur + 0.3 * noise * batch.response_mask(), cur - 0.2 * noise.abs() * batch.response_mask()
    per = N // info.world_size
    mine = list(range(info.rank * per, (info.rank + 1) * per))
    local = batch.select(mine)
    results = {}
    for mode in advantage.AGG_MODES:
        for loss in ("vanilla", "gspo"):
            for micro in (1, 2, 4):
                cfg = AlgorithmConfig(loss_agg_mode=mode, policy_loss=loss, micro_batch_size=micro,
                                      kl_loss_coef=0.1, entropy_coef=0.01, clip_high=0.28)
                policy.optimizer.zero_grad(set_to_none=True)
                grpo.accumulate_gradients(policy, local, list(range(per)), adv[mine], old[mine], ref[mine],
                                          dataclasses.replace(cfg), 0.9, info.world_size, info.device,
                                          norm_len=10)
                results[f"{mode}/{loss}/{micro}"] = grad_vector(policy)
    if info.rank == 0:
        torch.save(results, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
