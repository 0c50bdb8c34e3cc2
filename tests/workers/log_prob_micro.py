"""Worker (torchrun, 2 ranks): the no-gradient forwards' own micro-batches
(``algorithm.log_prob_micro_batch_size`` / ``log_prob_micro_batch_tokens``) through the real FSDP2
engine in fp32 on grad_invariance's batch (two prompt groups, unequal responses, a lone EOS; the
second group split over the ranks).

1. One whole train phase (``grpo.train_on_batch``: old log-probs, since mini_batches 2; reference
   log-probs, since kl_loss_coef > 0; two optimizer steps) on two policies built alike, one with
   the training micro-batch for every forward, one with ``log_prob_micro_batch_size`` 8: their
   metrics and their updated parameters are saved.
2. Then (the policy now differs from the frozen reference) the old-policy and reference log-probs
   as ``train_on_batch`` computes them (``compute_logprobs_in_chunks`` with ``log_prob_micro(cfg)``)
   for the training micro-batch and each of ``VARIANTS``, and how many forwards each split runs.

    torchrun --nproc_per_node=2 tests/workers/log_prob_micro.py MODEL_DIR OUT.pt
"""

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import sys

import torch

from rlcore import advantage
from rlcore.algo import grpo
from rlcore.algo.log_prob import log_prob_micro
from rlcore.config import AlgorithmConfig
from rlcore.dist import init_distributed
from grad_invariance import GROUP, N, global_batch  # this directory is on sys.path under torchrun

TRAIN = dict(micro_batch_size=2, mini_batches=2, kl_loss_coef=0.1, entropy_coef=0.01, share_prompt=False)
# name -> the no-gradient keys over TRAIN; "train" (none set) is what the others must equal
VARIANTS = {
    "train": {},
    "size1": dict(log_prob_micro_batch_size=1),
    "size2": dict(log_prob_micro_batch_size=2),
    "size8": dict(log_prob_micro_batch_size=8),
    "tokens40": dict(log_prob_micro_batch_tokens=40),
    "shared+tokens40": dict(log_prob_micro_batch_tokens=40, share_prompt=True),
}
TEMPERATURE = 0.9


def flat_params(policy) -> torch.Tensor:
    """The policy's parameters, unsharded and flattened in order (collective)."""
    from torch.distributed.tensor import DTensor

    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten().float().cpu()
                      for _, p in policy.model.named_parameters()])


def main():
    model_dir, out = sys.argv[1], sys.argv[2]
    info = init_distributed("cpu")
    from rlcore.engine_veomni import VeOmniPolicy

    ref = VeOmniPolicy(model_dir, info, trainable=False)
    policies = [VeOmniPolicy(model_dir, info, lr=1e-2, total_steps=2) for _ in range(2)]
    batch, rewards = global_batch()
    adv = advantage.compute_advantages("grpo", rewards, batch.response_mask(), GROUP)  # (N, T)
    per = N // info.world_size
    mine = list(range(info.rank * per, (info.rank + 1) * per))
    local, l_adv = batch.select(mine), adv[mine]
    results = {"init/params": flat_params(policies[0])}
    for name, policy, keys in (("step/train", policies[0], {}), ("step/size8", policies[1], VARIANTS["size8"])):
        cfg = AlgorithmConfig(**TRAIN, **keys)
        metrics = grpo.train_on_batch(policy, ref, local, l_adv, cfg, TEMPERATURE, info.world_size, info.device,
                                      norm_len=10)
        results.update({f"{name}/{k}": torch.tensor(float(v)) for k, v in metrics.items()})
        results[f"{name}/params"] = flat_params(policy)
    policy = policies[0]  # trained: its log-probs differ from the reference's
    for name, keys in VARIANTS.items():
        cfg = log_prob_micro(AlgorithmConfig(**{**TRAIN, **keys}))
        results[f"old/{name}"] = grpo.compute_logprobs_in_chunks(policy, local, TEMPERATURE, cfg, info.device,
                                                                 shared=True).cpu()
        with ref.on_device():
            results[f"ref/{name}"] = grpo.compute_logprobs_in_chunks(ref, local, TEMPERATURE, cfg, info.device,
                                                                     shared=True).cpu()
        results[f"forwards/{name}"] = torch.tensor(float(len(grpo.split_micro(local, list(range(per)), cfg))))
    results["mask"] = local.response_mask()
    gathered = [None] * info.world_size
    torch.distributed.all_gather_object(gathered, results)
    if info.rank == 0:
        torch.save(gathered, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
