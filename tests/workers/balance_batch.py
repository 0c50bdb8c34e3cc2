"""Worker (torchrun, W gloo ranks): trainer.balance_batch through the real FSDP2 engine. One global
batch of W x 8 samples (groups of 4), rank 0's responses long and the others' short; advantages
over the whole batch. Each rank takes its contiguous share; then once as it is and once after
``rlcore.step.balance.balance`` (the all-to-all move), every mini-batch's gradient is accumulated
(``grpo.accumulate_gradients``, global normalisers, no optimizer step) for every aggregation mode.
Old and reference log-probs are the current ones plus noise seeded by the sample's global index
(carried in ``answers``), so they are the same wherever the sample trains. Rank 0 saves the gradients
and the balance statistics.

    torchrun --nproc_per_node=W tests/workers/balance_batch.py MODEL_DIR OUT.pt [mini=M] [ulysses=U]
"""

import gc

gc.disable()  # a short-lived worker (rlcore.heap)

import sys

import torch

from rlcore import advantage
from rlcore.algo import balance as partition
from rlcore.algo import grpo
from rlcore.algo.batch import RolloutBatch
from rlcore.algo.packing import micro_batches
from rlcore.config import AlgorithmConfig
from rlcore.dist import all_gather_objects, init_distributed
from rlcore.step import balance
from grad_invariance import grad_vector  # this directory is on sys.path under torchrun

PER_RANK, GROUP = 8, 4


def global_batch(world: int) -> tuple[RolloutBatch, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = world * PER_RANK
    prompts = [torch.randint(3, 26, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n // GROUP)]
    lengths = [int(torch.randint(14, 24, (1,), generator=g)) if j < PER_RANK else
               int(torch.randint(1, 5, (1,), generator=g)) for j in range(n)]  # rank 0: the long ones
    responses = [torch.randint(3, 26, (m,), generator=g).tolist() for m in lengths]
    batch = RolloutBatch([prompts[j // GROUP] for j in range(n)], responses, [[0.0] * m for m in lengths],
                         [str(j) for j in range(n)], ["stop"] * n, GROUP)  # answers: the global index
    return batch, torch.rand(n, generator=g)


def noise_for(batch: RolloutBatch, t: int) -> torch.Tensor:
    """(N, t) noise of each sample seeded by its global index: independent of where it trains."""
    # always 64 draws, then the first t: torch's CPU normal_ draws differently below and above 16 values
    return torch.stack([torch.randn(64, generator=torch.Generator().manual_seed(int(a)))[:t] for a in batch.answers])


def gradients(policy, batch, adv, info, mini: int, tag: str, results: dict) -> None:
    noise = noise_for(batch, adv.shape[1])
    batch, (adv, noise), _ = grpo.sp_group_batch(policy, batch, adv, noise)  # Ulysses: the group's samples
    mask = batch.response_mask()
    cur = grpo.compute_logprobs_in_chunks(policy, batch, 0.9, 4, info.device, shared=True)
    old, ref = cur + 0.3 * noise * mask, cur - 0.2 * noise.abs() * mask
    for mode in advantage.AGG_MODES:
        cfg = AlgorithmConfig(loss_agg_mode=mode, kl_loss_coef=0.1, entropy_coef=0.01, clip_high=0.28,
                              micro_batch_size=3, mini_batches=mini)
        inp = grpo.UpdateInputs(adv, old, ref, torch.zeros_like(old), mask, 0.9, info.world_size, norm_len=24)
        for k, idx in enumerate(micro_batches(len(batch), len(batch) // mini)):  # ppo_update's mini-batches
            for opt in policy._inner_optimizers():
                opt.zero_grad(set_to_none=True)
            grpo.accumulate_gradients(policy, batch, idx, inp, cfg)
            results[f"{tag}/{mode}/mini{k}"] = grad_vector(policy)


def main():
    model_dir, out = sys.argv[1], sys.argv[2]
    opts = {k: int(v) for k, v in (a.split("=") for a in sys.argv[3:])}
    mini, ulysses = opts.get("mini", 1), opts.get("ulysses", 1)
    info = init_distributed("cpu")
    from rlcore.engine_veomni import VeOmniPolicy

    policy = VeOmniPolicy(model_dir, info, lr=1e-3, total_steps=1, ulysses_size=ulysses)
    batch, rewards = global_batch(info.world_size)
    adv = advantage.compute_advantages("grpo", rewards, batch.response_mask(), GROUP)  # (N, T) group-wise, global
    mine = list(range(info.rank * PER_RANK, (info.rank + 1) * PER_RANK))
    local = batch.select(mine)
    l_adv = adv[mine][:, : local.response_mask().shape[1]]
    results = {}
    gradients(policy, local, l_adv, info, mini, "off", results)
    moved, m_adv, m_scores, stats = balance.balance(local, l_adv, rewards[mine], mini, ulysses)
    ids = [int(a) for a in moved.answers]
    assert torch.equal(m_scores, rewards[ids]), "scores travel with their samples"
    assert torch.equal(m_adv, adv[ids][:, : m_adv.shape[1]]), "advantages travel with their samples"
    gradients(policy, moved, m_adv, info, mini, "on", results)
    every = all_gather_objects(ids)  # each sample trains exactly once
    assert sorted(i for x in every for i in x) == list(range(len(batch))), every
    tokens = [len(batch.prompt_ids[i]) + len(batch.response_ids[i]) for i in range(len(batch))]
    per_part = [sum(tokens[i] for x in every[p: p + ulysses] for i in x) for p in range(0, len(every), ulysses)]
    # the bound: per mini-batch slot longest minus shortest (the slots: positions of each part's batch)
    size = PER_RANK * ulysses
    bound = 0
    for lo in range(0, size, size // mini):
        slot = [tokens[x[pos % PER_RANK]] for p in range(0, len(every), ulysses)
                for pos in range(lo, lo + size // mini) for x in [every[p + pos // PER_RANK]]]
        bound += partition.spread_bound(slot)
    results.update({"max_over_mean_before": torch.tensor(stats["perf/rank_tokens_max_over_mean_before"]),
                    "max_over_mean": torch.tensor(stats["perf/rank_tokens_max_over_mean"]),
                    "spread": torch.tensor(float(max(per_part) - min(per_part))),
                    "spread_bound": torch.tensor(float(bound))})
    assert abs(partition.max_over_mean(per_part) - stats["perf/rank_tokens_max_over_mean"]) < 1e-9
    if info.rank == 0:
        torch.save(results, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
