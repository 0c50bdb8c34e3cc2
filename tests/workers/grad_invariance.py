"""Worker (torchrun, 1 or 2 ranks): the gradient of one optimizer step's loss for every aggregation
mode and each packing variant (``VARIANTS``: micro-batch sizes 1, 2 and 4, every position through
the LM head or only the response-predicting ones, shared-prompt packing, token-budget
micro-batches), through the real FSDP2 engine. Rank r of W trains on its contiguous share of one
fixed global batch; rank 0 saves the unsharded gradients.

The batch is two prompt groups of 3 and 5 samples with unequal response lengths, one of them a
lone EOS (a response of one token): on 2 ranks the second group is split, a partial group on each.

    torchrun --nproc_per_node=W tests/workers/grad_invariance.py MODEL_DIR OUT.pt [ULYSSES_SIZE]

With ULYSSES_SIZE > 1 the ranks form Ulysses sequence-parallel groups (rlcore.engine.ulysses): each
rank still holds its own share, and the group's shares are gathered as ``grpo.train_on_batch``
gathers them (``grpo.sp_group_batch``), so every rank of a group runs 1/U of each packed row.
"""

import sys

import torch

from rlcore.algo import advantage, grpo
from rlcore.algo.batch import RolloutBatch
from rlcore.config import AlgorithmConfig
from rlcore.dist import init_distributed

N, GROUP = 8, 4
# name -> AlgorithmConfig fields; "full" is the reference: every position through the LM head
VARIANTS = {
    "full": dict(response_only_logits=False, micro_batch_size=4),
    **{str(m): dict(micro_batch_size=m) for m in (1, 2, 4)},
    "share/2": dict(share_prompt=True, micro_batch_size=2),
    "share/4": dict(share_prompt=True, micro_batch_size=4),
    "budget": dict(micro_batch_tokens=24),
    "share+budget": dict(share_prompt=True, micro_batch_tokens=24),
}


def global_batch() -> tuple[RolloutBatch, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    group_a, group_b = (torch.randint(3, 26, (n,), generator=g).tolist() for n in (5, 8))
    prompts = [group_a] * 3 + [group_b] * 5
    lengths = [7, 1, 4, 9, 3, 5, 2, 8]
    responses = [torch.randint(3, 26, (n,), generator=g).tolist() for n in lengths]
    batch = RolloutBatch(prompts, responses, [[0.0] * n for n in lengths], ["x"] * N, ["stop"] * N, GROUP)
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
    ulysses = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    info = init_distributed("cpu")
    from rlcore.engine.policy import VeOmniPolicy

    policy = VeOmniPolicy(model_dir, info, lr=1e-3, total_steps=1, ulysses_size=ulysses)
    batch, rewards = global_batch()
    adv = advantage.compute_advantages("grpo", rewards, batch.response_mask(), GROUP)  # (N, T) global
    # Old/ref log-probs off the current ones, so clipping, dual clip and KL are all active.
    cur = grpo.compute_logprobs_in_chunks(policy, batch, 0.9, N, info.device, shared=True)  # the same everywhere
    noise = torch.randn(cur.shape, generator=torch.Generator().manual_seed(1))
    old, ref = cur + 0.3 * noise * batch.response_mask(), cur - 0.2 * noise.abs() * batch.response_mask()
    per = N // info.world_size
    mine = list(range(info.rank * per, (info.rank + 1) * per))
    local, (l_adv, l_old, l_ref), _ = grpo.sp_group_batch(policy, batch.select(mine), adv[mine], old[mine], ref[mine])
    results = {}
    for mode in advantage.AGG_MODES:
        for loss in ("vanilla", "gspo"):
            for name, fields in VARIANTS.items():
                cfg = AlgorithmConfig(loss_agg_mode=mode, policy_loss=loss, kl_loss_coef=0.1, entropy_coef=0.01,
                                      clip_high=0.28, **fields)
                policy.optimizer.zero_grad(set_to_none=True)
                inp = grpo.UpdateInputs(l_adv, l_old, l_ref, torch.zeros_like(l_old), local.response_mask(), 0.9,
                                        info.world_size, norm_len=10)
                grpo.accumulate_gradients(policy, local, list(range(len(local))), inp, cfg)
                results[f"{mode}/{loss}/{name}"] = grad_vector(policy)
    if policy.sp is not None:  # the Ulysses path really ran: rows sliced, padding counted
        results["sp/row_tokens"] = torch.tensor(float(policy.sp.row_tokens))
        results["sp/pad_tokens"] = torch.tensor(float(policy.sp.pad_tokens))
    if info.rank == 0:
        torch.save(results, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
